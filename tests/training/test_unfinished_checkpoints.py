"""A process killed while Levanter writes metadata.json leaves it empty: the next attempt sets that checkpoint
aside and resumes from the one before, instead of failing in Levanter's discovery."""

import json

from marin_assets.training.train_main import UNFINISHED_CHECKPOINTS_DIR, set_aside_unfinished_checkpoints


def _checkpoint(root, step, metadata: str | None):
    path = root / f"step-{step}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "weights").write_bytes(b"w" * 16)
    if metadata is not None:
        (path / "metadata.json").write_text(metadata)
    return path


def test_an_empty_or_torn_metadata_is_set_aside_and_the_previous_checkpoint_is_discovered(tmp_path):
    from levanter.checkpoint import discover_latest_checkpoint

    root = tmp_path / "checkpoints"
    good = json.dumps({"step": 9, "timestamp": "2026-12-05T10:00:00"})
    _checkpoint(root, 9, good)
    _checkpoint(root, 19, "")  # killed between open("w") and json.dump
    _checkpoint(root, 29, '{"step": 29, "times')  # killed mid-write
    _checkpoint(root, 39, None)  # killed before metadata: discovery already skips it, left where it is

    moved = set_aside_unfinished_checkpoints(str(root))

    assert [p.rsplit("/", 1)[-1].split("-")[1] for p in moved] == ["19", "29"]
    kept = sorted(p.name for p in (root / UNFINISHED_CHECKPOINTS_DIR).iterdir())
    assert len(kept) == 2 and all((root / UNFINISHED_CHECKPOINTS_DIR / k / "model" / "weights").exists() for k in kept)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-39", "step-9"]
    assert discover_latest_checkpoint(str(root)) == str(root / "step-9")
    assert set_aside_unfinished_checkpoints(str(root)) == []  # a second attempt finds nothing more


def test_no_checkpoint_dir_yet_is_nothing_to_do(tmp_path):
    assert set_aside_unfinished_checkpoints(str(tmp_path / "absent")) == []
