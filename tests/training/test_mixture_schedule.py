"""Mixture schedules: a run's weights change at declared steps (Levanter's varying mixture). The
schedule is part of the run's identity only when declared, renders to Levanter's ``train_weights``
stages, and a real run that switches sources shows the switch in each source's validation loss."""

import dataclasses
import json
import os
import subprocess
import sys

import data_fixtures
import pytest
from conftest import SUBPROCESS_ENV, tiny_spec

from marin_assets.training.levanter_config import build_train_config, parse_train_config, write_train_config
from marin_assets.training.spec import MixtureStage, RunSpec, RunSpecError, validate_run

PROSE, CODE = "prose", "code"


def two_source_mixture(prose_root: str, code_root: str, tokenizer_dir: str) -> dict:
    """Two pre-built caches on one tokenizer, equally weighted (what the tokenization stage renders)."""
    return {"tokenizer": tokenizer_dir, "cache_dir": None, "mixture_block_size": 2048,
            "configs": {name: {"cache_dir": root, "train_urls": [], "validation_urls": []}
                        for name, root in ((PROSE, prose_root), (CODE, code_root))},
            "train_weights": {PROSE: 1.0, CODE: 1.0}}


def switching_spec(switch_at: int, steps: int, **overrides) -> RunSpec:
    """Prose only until ``switch_at``, code only after."""
    return tiny_spec("switch", steps=steps, mixture="prose+code", tokenizer="prose+code", watch_every=0,
                     mixture_schedule=(MixtureStage(step=switch_at, weights={CODE: 1.0}),), **overrides)


def test_a_schedule_is_identity_only_when_declared():
    fixed = tiny_spec()
    assert "mixture_schedule" not in fixed.identity()  # runs on fixed weights keep their fingerprints
    scheduled = dataclasses.replace(fixed, mixture_schedule=(MixtureStage(step=10, weights={"a": 1.0}),))
    assert scheduled.identity()["mixture_schedule"] == [{"step": 10, "weights": {"a": 1.0}}]
    later = dataclasses.replace(fixed, mixture_schedule=(MixtureStage(step=20, weights={"a": 1.0}),))
    assert len({fixed.fingerprint(), scheduled.fingerprint(), later.fingerprint()}) == 3


@pytest.mark.parametrize("stages, field, message", [
    ([(0, {"a": 1.0})], "mixture_schedule[0].step", "must lie after the previous stage's step (0)"),
    ([(30, {"a": 1.0})], "mixture_schedule[0].step", "before num_train_steps=30, got 30"),
    ([(10, {"a": 1.0}), (10, {"b": 1.0})], "mixture_schedule[1].step", "previous stage's step (10)"),
    ([(10, {"a": -1.0, "b": 2.0})], "mixture_schedule[0].weights", "must all be >= 0"),
    ([(10, {"a": 0.0})], "mixture_schedule[0].weights", "must give some component a weight > 0"),
])
def test_a_bad_schedule_is_refused_naming_the_stage(stages, field, message):
    spec = tiny_spec(mixture_schedule=tuple(MixtureStage(step=s, weights=w) for s, w in stages))
    with pytest.raises(RunSpecError, match=r"field '" + field.replace("[", r"\[").replace("]", r"\]")) as caught:
        validate_run(spec)
    assert message in str(caught.value)


def test_the_schedule_renders_to_levanters_varying_mixture(tmp_path, tiny_artifact):
    cache_root, tokenizer_dir = tiny_artifact
    data = two_source_mixture(cache_root, cache_root, tokenizer_dir)
    config = build_train_config(switching_spec(40, 80, train_batch_size=8), data, tokenizer_dir, str(tmp_path))
    assert config["data"]["train_weights"] == [[0, {PROSE: 1.0, CODE: 1.0}], [40, {PROSE: 0.0, CODE: 1.0}]]
    # Levanter switches at a block boundary: 40 steps x 8 sequences = 320 = 5 blocks of 64.
    assert config["data"]["mixture_block_size"] == 64
    parsed = parse_train_config(write_train_config(config, tmp_path / "train_config.yaml")).data
    assert parsed.train_weights == [(0, {PROSE: 1.0, CODE: 1.0}), (40, {PROSE: 0.0, CODE: 1.0})]
    with pytest.raises(ValueError, match=r"mixture_schedule weighs \['verse'\], not components"):
        build_train_config(tiny_spec(mixture_schedule=(MixtureStage(step=5, weights={"verse": 1.0}),)), data,
                           tokenizer_dir, str(tmp_path))


@pytest.mark.slow
def test_a_switch_to_another_source_shows_in_each_sources_loss(tmp_path):
    """80 steps on prose alone, then 80 on code alone: each source's validation loss gains on the
    other's while it is the one trained on."""
    prose, code = data_fixtures.stdlib_docstrings(), data_fixtures.stdlib_sources()[:120]
    tokenizer_dir = data_fixtures.train_byte_bpe_tokenizer(prose + code, tmp_path / "tokenizer", 512)
    roots = [data_fixtures.write_split_caches(texts, tokenizer_dir, tmp_path / name)
             for name, texts in ((PROSE, prose), (CODE, code))]
    switch, steps = 80, 160
    spec = switching_spec(switch, steps, steps_per_eval=20, max_eval_batches=4)
    data = two_source_mixture(*roots, tokenizer_dir)
    data["train_weights"] = {PROSE: 1.0, CODE: 0.0}  # the mixture starts on prose alone
    out = tmp_path / "run"
    config_path = write_train_config(build_train_config(spec, data, tokenizer_dir, str(out)), out / "train_config.yaml")
    done = subprocess.run([sys.executable, "-m", "marin_assets.training.train_main", "--config", config_path,
                           "--output-dir", str(out)], env={**os.environ, **SUBPROCESS_ENV},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: {name: r[f"eval/{name}/loss"] for name in (PROSE, CODE)}
            for r in records if f"eval/{PROSE}/loss" in r}
    assert switch in loss and max(loss) >= steps - 1, loss
    start, end = loss[min(loss)], loss[max(loss)]

    def code_behind_prose(at: dict) -> float:
        return at[CODE] - at[PROSE]

    # Measured: code's loss falls behind prose's while only prose is trained on (a gap of +0.02 at
    # step 0, +0.23 at the switch) and overtakes it once only code is (-0.14 at the end).
    assert code_behind_prose(loss[switch]) > code_behind_prose(start) + 0.1, loss
    assert code_behind_prose(end) < code_behind_prose(loss[switch]) - 0.2, loss
    assert end[CODE] < loss[switch][CODE] - 0.3, loss
