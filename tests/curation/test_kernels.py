"""The compiled kernels are visible: built where a compiler is, a missing one logged once per process,
and the `filtered/` manifests saying which ran without it changing their data version."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from marin_assets.curation import kernels
from marin_assets.curation.filters import text_stats
from marin_assets.curation.minhash import MinHashConfig, minhash_texts, numpy_minhash_texts
from marin_assets.run_submission import InProcessRuns
from marin_resources.keys import asset_key

from .conftest import NORMAL_TEXT


@pytest.mark.compiled_kernels
def test_the_compiled_kernels_are_built_here():
    """An install with a C compiler builds every kernel; a missing one here is a broken build."""
    assert {name: module is not None for name, module in kernels.MODULES.items()} == {
        "_langid": True, "_minhash": True, "_textstats": True}
    assert kernels.implementation() == kernels.COMPILED


def test_a_missing_kernel_is_logged_once_per_process(monkeypatch, caplog):
    import polars as pl

    monkeypatch.setattr(kernels, "_warned", False)
    monkeypatch.setitem(kernels.MODULES, "_minhash", None)
    monkeypatch.setitem(kernels.MODULES, "_textstats", None)
    texts = [NORMAL_TEXT, "a b c d e f g"]
    config = MinHashConfig()
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        for _ in range(2):
            assert np.array_equal(minhash_texts(texts, config), numpy_minhash_texts(texts, config))
            text_stats(pl.DataFrame({"text": texts}))
    (record,) = [r for r in caplog.records if r.name == kernels.__name__]
    assert "marin_assets.curation._minhash, marin_assets.curation._textstats not built" in record.getMessage()
    assert "_langid" not in record.getMessage()
    assert kernels.implementation() == kernels.NUMPY


def test_filtered_records_its_kernel_and_the_numpy_build_has_the_same_data_version(curation_planner, tmp_path,
                                                                                    monkeypatch):
    data = tmp_path / "letters"
    data.mkdir()
    (data / "river.txt").write_text(NORMAL_TEXT)
    plan = curation_planner(f"sources:\n  - name: letters\n    uri: {data}/*.txt\n    format: text\n"
                            "    filters:\n      languages: [en]\n      language_identifier: langid\n")
    plan.discover()
    key = asset_key("filtered/letters")
    (partition,) = plan.partitions_of(key)

    def build():
        steps = plan.materialize(key, partition, log=lambda m: None, runs=InProcessRuns(plan.defs, plan.instance))
        assert all(s.success for s in steps), [s.error for s in steps]
        return plan.current(key, partition)

    first = build()
    assert first.metrics["kernel"] == kernels.implementation()
    assert first.metrics["language/en"] == 1  # langid ran (the _langid kernel or its twin), as the source chose
    for name in kernels.MODULES:
        monkeypatch.setitem(kernels.MODULES, name, None)
    plan.retract(key, partition, log=lambda m: None)  # as `marin materialize --rebuild` does
    numpy_build = build()
    assert numpy_build.metrics["kernel"] == kernels.NUMPY
    assert numpy_build.producer["run_id"] != first.producer["run_id"]  # built again
    assert (numpy_build.fingerprint, numpy_build.data_version) == (first.fingerprint, first.data_version)
    assert [(f.path, f.sha256) for f in numpy_build.files] == [(f.path, f.sha256) for f in first.files]
