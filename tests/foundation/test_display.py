"""Metadata as the web UI shows it: rounded floats, human bytes and durations, records as tables;
the manifest keeps the raw values."""

import dagster as dg
import pytest

from marin_resources.display import display_metadata, human_bytes, human_duration, parse_duration, records_table


def test_floats_bytes_and_durations_read_well():
    shown = display_metadata({"mfu": 0.3186923250783385, "raw_bytes": 3 * 2**20 + 512, "marin/bytes": 999,
                              "train_seconds": 4000.2, "marin/build_seconds": 2.71828, "bytes_per_token": 3.14159,
                              "documents": 12, "marin/reused": False, "loss": float("nan")})
    assert shown["mfu"] == 0.3187 and shown["bytes_per_token"] == 3.142 and shown["documents"] == 12
    assert shown["raw_bytes"] == dg.MetadataValue.text("3 MiB") and shown["marin/bytes"].value == "999 B"
    assert shown["train_seconds"].value == "1 h 06 min" and shown["marin/build_seconds"].value == "2.72 s"
    assert shown["marin/reused"] is False and shown["loss"] != shown["loss"]  # NaN stays NaN
    assert human_bytes(5 * 2**40) == "5 TiB" and human_duration(61) == "1 min 01 s"


def test_durations_read_back_to_their_precision():
    for seconds, text in [(2.71828, "2.72 s"), (61, "1 min 01 s"), (4000.2, "1 h 06 min"), (0.0004, "0.0004 s")]:
        assert human_duration(seconds) == text
        assert parse_duration(text) == pytest.approx(seconds, rel=0.02, abs=30 if seconds >= 3600 else 0)
    for bad in ("", "3", "2.7 sec", "1 min 5"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)


def test_eval_samples_are_a_table():
    table = records_table([{"prompt": "To be", "completion": " or not"}, {"prompt": "Once", "completion": None}])
    assert [c.name for c in table.schema.columns] == ["prompt", "completion"]
    assert table.records[1].data == {"prompt": "Once", "completion": ""}
    fit = records_table([{"flops": 1e18, "loss": 3.14159265, "interior": True}])
    assert fit.records[0].data == {"flops": "1e+18", "loss": "3.142", "interior": "True"}
