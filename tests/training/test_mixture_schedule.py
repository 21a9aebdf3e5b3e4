"""Mixture schedules: a run's weights change at declared steps (Levanter's varying mixture). The
schedule is part of the run's identity only when declared, renders to Levanter's ``train_weights``
stages, and a real run that switches sources shows the switch in each source's validation loss."""

import dataclasses
import json
import os
import subprocess
import sys

import dagster as dg
import data_fixtures
import pytest
from conftest import SUBPROCESS_ENV, tiny_spec

from marin_assets.training.levanter_config import build_train_config, parse_train_config, write_train_config
from marin_assets.training.spec import Cooldown, MixtureStage, RunSpec, RunSpecError, validate_run

PROSE, CODE = "prose", "code"


def two_source_mixture(prose_root: str, code_root: str, tokenizer_dir: str) -> dict:
    """Two pre-built caches on one tokenizer, equally weighted (what the tokenization stage renders)."""
    return {"tokenizer": tokenizer_dir, "cache_dir": None, "mixture_block_size": 2048,
            "configs": {name: {"cache_dir": root, "train_urls": [], "validation_urls": []}
                        for name, root in ((PROSE, prose_root), (CODE, code_root))},
            "train_weights": {PROSE: 1.0, CODE: 1.0}}


def switching_spec(switch_at: int, steps: int, **overrides) -> RunSpec:
    """Prose only until ``switch_at``, code only after."""
    return tiny_spec("switch", steps=steps, mixture="prose_code", tokenizer="prose_code", watch_every=0,
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


@pytest.fixture(scope="module")
def prose_and_code(tmp_path_factory) -> dict:
    """A mixture of two real sources on one 512-token tokenizer: stdlib docstrings and stdlib code."""
    out = tmp_path_factory.mktemp("prose_and_code")
    prose, code = data_fixtures.stdlib_docstrings(), data_fixtures.stdlib_sources()[:120]
    tokenizer_dir = data_fixtures.train_byte_bpe_tokenizer(prose + code, out / "tokenizer", 512)
    roots = [data_fixtures.write_split_caches(texts, tokenizer_dir, out / name)
             for name, texts in ((PROSE, prose), (CODE, code))]
    return two_source_mixture(*roots, tokenizer_dir)


def train(spec: RunSpec, data: dict, out, **config) -> dict[int, dict]:
    """Train ``spec`` on ``data`` in a training process; its metrics.jsonl records by step."""
    config_path = write_train_config(build_train_config(spec, data, data["tokenizer"], str(out), **config),
                                     out / "train_config.yaml")
    done = subprocess.run([sys.executable, "-m", "marin_assets.training.train_main", "--config", config_path,
                           "--output-dir", str(out)], env={**os.environ, **SUBPROCESS_ENV},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def eval_losses(records: dict[int, dict]) -> dict[int, dict[str, float]]:
    return {step: {name: r[f"eval/{name}/loss"] for name in (PROSE, CODE)}
            for step, r in records.items() if f"eval/{PROSE}/loss" in r}


def code_behind_prose(at: dict[str, float]) -> float:
    return at[CODE] - at[PROSE]


@pytest.mark.slow
def test_a_switch_to_another_source_shows_in_each_sources_loss(tmp_path, prose_and_code):
    """80 steps on prose alone, then 80 on code alone: each source's validation loss gains on the
    other's while it is the one trained on."""
    switch, steps = 80, 160
    data = {**prose_and_code, "train_weights": {PROSE: 1.0, CODE: 0.0}}  # the mixture starts on prose alone
    loss = eval_losses(train(switching_spec(switch, steps, steps_per_eval=20, max_eval_batches=4), data,
                             tmp_path / "run"))
    assert switch in loss and max(loss) >= steps - 1, loss
    start, end = loss[min(loss)], loss[max(loss)]
    # Measured: code's loss falls behind prose's while only prose is trained on (a gap of +0.02 at
    # step 0, +0.23 at the switch) and overtakes it once only code is (-0.13 at the end).
    assert code_behind_prose(loss[switch]) > code_behind_prose(start) + 0.1, loss
    assert code_behind_prose(end) < code_behind_prose(loss[switch]) - 0.2, loss
    assert end[CODE] < loss[switch][CODE] - 0.3, loss


@pytest.mark.slow
def test_a_cooldown_continues_the_base_checkpoint_and_anneals_on_a_new_mixture(tmp_path, prose_and_code):
    """A base run on prose alone keeps a checkpoint at step 40; the cooldown continues it there
    (weights, optimizer state, step count) for 30 steps on code alone, the learning rate falling
    linearly towards zero (min_lr_ratio 0)."""
    prose_only = {**prose_and_code, "train_weights": {PROSE: 1.0, CODE: 0.0}}
    code_only = {**prose_and_code, "train_weights": {PROSE: 0.0, CODE: 1.0}}
    base = tiny_spec("base", steps=80, checkpoint_every=40, mixture="prose", tokenizer="both", watch_every=0,
                     steps_per_eval=40, max_eval_batches=4)
    base_records = train(base, prose_only, tmp_path / "base")
    start = tmp_path / "base" / "checkpoints" / "step-40"
    assert (start / "metadata.json").is_file()

    cooldown = dataclasses.replace(base, name="cooldown", mixture="code", num_train_steps=30, steps_per_eval=30,
                                   cooldown=Cooldown(run="base", step=40),
                                   optimizer=dataclasses.replace(base.optimizer, learning_rate=5e-3, warmup=0.0,
                                                                 schedule="linear", min_lr_ratio=0.0))
    records = train(cooldown, code_only, tmp_path / "cooldown", cooldown_from=str(start))
    steps = sorted(s for s, r in records.items() if "loss" in r)
    assert (steps[0], steps[-1]) == (41, 70), steps  # the 30 steps after the base's step-40 (its 41st)
    rates = [records[s]["learning_rate"] for s in steps]
    assert rates[0] == pytest.approx(5e-3, rel=0.05) and rates[-1] < 5e-3 / 20, rates
    assert all(a >= b for a, b in zip(rates, rates[1:])), rates
    # The base's weights, not a fresh start: the first loss on code is near the base's code loss at
    # step 40, far below the untrained model's.
    base_loss, loss = eval_losses(base_records), eval_losses(records)
    assert records[41]["loss"] < base_records[0]["loss"] - 0.5, (records[41], base_records[0])
    assert records[41]["loss"] == pytest.approx(base_loss[40][CODE], abs=0.3), (records[41], base_loss)
    # Annealed on code, code's loss gains on prose's (measured: +0.27 at the base's step 40, +0.06 at the end).
    assert code_behind_prose(loss[max(loss)]) < code_behind_prose(base_loss[40]) - 0.2, (base_loss, loss)


def test_a_mixture_sweeps_points_are_partitions_of_its_own_assets(tmp_path, synthetic_deployment):
    """Each set of weights is a run of the sweep (`<sweep>-w<i>`): the base run with those weights, in
    its identity, trained as a partition of `mixture_sweep_checkpoint/<sweep>` on them."""
    from test_init_from import RecordingLauncher, _commit, _registry

    from marin_assets.reports.comparison import run_locations
    from marin_assets.scaling_sweeps.assets import build_scaling_sweeps_stage
    from marin_assets.scaling_sweeps.config import extend_mixture_sweeps
    from marin_assets.stages import build_catalog, build_stage
    from marin_assets.training.assets import CHECKPOINT_VERSION, EVAL_VERSION
    from marin_assets.training.spec import load_run_registry
    from marin_resources.environments import MarinSettings, build_resources
    from marin_resources.keys import asset_key

    runs = load_run_registry(_registry(tmp_path, base={}))
    sweeps = extend_mixture_sweeps({}, {"mix": {"run": "base", "weights": [{PROSE: 1.0}, {PROSE: 1.0, CODE: 3.0}]}},
                                   runs, "marin.yaml")
    deployment = dataclasses.replace(synthetic_deployment(runs=runs), mixture_sweeps=sweeps)
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store")})
    resources = build_resources(settings)
    store = resources["store"].get()
    caches = {name: _commit(store, f"tokenized/{name}", None, {"train/input_ids": b"rows"}).uri
              for name in (PROSE, CODE)}
    _commit(store, "mixture/m", None, {"data.json": json.dumps({
        "cache_dir": None, "train_weights": {PROSE: 1.0, CODE: 1.0},
        "configs": {name: {"cache_dir": uri} for name, uri in caches.items()}}).encode()})
    _commit(store, "tokenizer/t", None, {"tokenizer.json": b"{}"})
    calls: list = []
    resources["launcher"] = RecordingLauncher.make(calls)
    defs, catalog = build_stage(build_scaling_sweeps_stage, settings, deployment)
    [checkpoint] = [a for a in defs.assets if a.key == asset_key("mixture_sweep_checkpoint/mix")]
    assert catalog.discoverers["mix_mixture_runs"]() == ["mix-w0", "mix-w1"]
    identity = catalog.specs["mixture_sweep_checkpoint/mix"].identity
    assert identity("mix-w1")["mixture_weights"] == {PROSE: 1.0, CODE: 3.0}
    assert identity("mix-w0") != identity("mix-w1") and "mixture_weights" not in runs["base"].identity()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("mix_mixture_runs", ["mix-w0", "mix-w1"])
        assert dg.materialize([checkpoint], partition_key="mix-w1", instance=instance, resources=resources).success
    [(_, config)] = calls
    assert config["data"]["train_weights"] == {PROSE: 1.0, CODE: 3.0}
    manifest = store.find("mixture_sweep_checkpoint/mix", CHECKPOINT_VERSION, "mix-w1")
    assert manifest.config == identity("mix-w1")
    # `marin compare` finds the points where they are.
    located = run_locations(deployment, store, build_catalog(settings, deployment))["mix-w1"]
    assert located.checkpoint == ("mixture_sweep_checkpoint/mix", CHECKPOINT_VERSION)
    assert located.evaluations == (("mixture_sweep_eval/mix", EVAL_VERSION),)
