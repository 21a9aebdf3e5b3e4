import dataclasses

import pytest
from conftest import tiny_spec

from marin_assets.training.spec import (
    MeshShape,
    ParallelismSpec,
    ResourceSpec,
    RunSpecError,
    load_run_registry,
    validate_run,
)


def test_fingerprint_ignores_resources_but_not_identity_fields():
    base = tiny_spec()
    on_tpu = dataclasses.replace(base, resources=ResourceSpec(accelerator="tpu", device_count=8, tpu_type="v5litepod-8",
                                                              pool="tpu"))
    assert base.fingerprint() == on_tpu.fingerprint()
    assert "resources" not in base.identity()
    # The mesh splits the same global batch differently; the weights it trains are the same run's.
    sharded = dataclasses.replace(base, resources=ResourceSpec(device_count=8),
                                  parallelism=ParallelismSpec(data=2, fsdp=4))
    assert base.fingerprint() == sharded.fingerprint() and "parallelism" not in base.identity()
    assert base.fingerprint() != dataclasses.replace(base, train_batch_size=16).fingerprint()
    # Norm logging is observability: turning it off retrains nothing.
    assert base.fingerprint() == dataclasses.replace(base, watch_every=0).fingerprint()
    assert base.fingerprint() != dataclasses.replace(base, seed=1).fingerprint()
    wider = dataclasses.replace(base, model=dataclasses.replace(base.model, hidden_dim=64))
    assert base.fingerprint() != wider.fingerprint()
    assert len(base.fingerprint()) == 64


def test_existing_runs_keep_their_fingerprints():
    """Families and optimizers came later: a Llama trained with Adam serializes as it did before them
    (its identity has neither field), so no existing checkpoint is orphaned."""
    assert load_run_registry()["nano-shakespeare"].fingerprint() == \
        "cf19bfbff4fcdf3b6600a50a2a6298bfc784d9f00481744c62c632bea1a1f04e"
    base = tiny_spec()
    assert base.fingerprint() == "f91845d3f4b28f4f402adc8b5824c2f292993fa5c1c5f79db9dbc2b74f976fbe"
    assert "family" not in base.identity()["model"] and "type" not in base.identity()["optimizer"]
    # A family or an optimizer other than the default changes the math, so the identity.
    qwen = dataclasses.replace(base, model=dataclasses.replace(base.model, family="qwen"))
    lion = dataclasses.replace(base, optimizer=dataclasses.replace(base.optimizer, type="lion"))
    moe = dataclasses.replace(base, model=dataclasses.replace(base.model, family="mixtral", num_experts=4,
                                                               experts_per_token=2))
    assert qwen.identity()["model"]["family"] == "qwen" and lion.identity()["optimizer"]["type"] == "lion"
    assert moe.identity()["model"]["num_experts"] == 4
    fingerprints = {spec.fingerprint() for spec in (base, qwen, lion, moe)}
    assert len(fingerprints) == 4
    top1 = dataclasses.replace(moe, model=dataclasses.replace(moe.model, experts_per_token=1))
    assert top1.fingerprint() not in fingerprints


def test_builtin_registry_has_nano_shakespeare():
    runs = load_run_registry()
    nano = runs["nano-shakespeare"]
    assert nano.mixture == "shakespeare"
    assert nano.resources.accelerator == "cpu"
    assert 100 <= nano.num_train_steps <= 500


def _write(tmp_path, body: str):
    path = tmp_path / "runs.yaml"
    path.write_text(body)
    return path


GOOD = """
runs:
  r1:
    mixture: m
    tokenizer: t
    model: {hidden_dim: 32, intermediate_dim: 64, num_layers: 2, num_heads: 2, num_kv_heads: 2, seq_len: 64}
    optimizer: {learning_rate: 0.01}
    train_batch_size: 8
    num_train_steps: 10
"""


def test_registry_roundtrip_and_defaults(tmp_path):
    runs = load_run_registry(_write(tmp_path, GOOD))
    assert runs["r1"].optimizer.schedule == "cosine"
    assert runs["r1"].eval_sets == ()


@pytest.mark.parametrize(
    "edit, field, message",
    [
        (("train_batch_size: 8", "train_batch_size: eight"), "train_batch_size", "expected an integer"),
        (("num_train_steps: 10", "num_train_steps: 10\n    epochs: 3"), "epochs", "unknown field"),
        (("optimizer: {learning_rate: 0.01}", "optimizer: {learning_rate: 0.01, schedule: step}"), "optimizer.schedule",
         "not one of"),
        (("hidden_dim: 32", "hidden_dim: 33"), "model.hidden_dim", "not divisible"),
        (("    tokenizer: t\n", ""), "tokenizer", "required field is missing"),
        (("num_train_steps: 10", "num_train_steps: 10\n    resources: {accelerator: tpu}"), "resources.tpu_type",
         "exactly when"),
        (("num_train_steps: 10", "num_train_steps: 10\n    watch_every: -1"), "watch_every", "must be >= 0"),
        (("seq_len: 64}", "seq_len: 64, family: gpt5}"), "model.family", "not one of"),
        (("learning_rate: 0.01}", "learning_rate: 0.01, type: sgd}"), "optimizer.type", "not one of"),
        (("seq_len: 64}", "seq_len: 64, family: mixtral}"), "model.num_experts", "required for family 'mixtral'"),
        (("seq_len: 64}", "seq_len: 64, family: mixtral, num_experts: 1, experts_per_token: 1}"), "model.num_experts",
         "at least 2 experts"),
        (("seq_len: 64}", "seq_len: 64, family: mixtral, num_experts: 4}"), "model.experts_per_token",
         "required for family 'mixtral'"),
        (("seq_len: 64}", "seq_len: 64, family: mixtral, num_experts: 4, experts_per_token: 5}"),
         "model.experts_per_token", "must be in [1, num_experts=4], got 5"),
        (("seq_len: 64}", "seq_len: 64, family: qwen, num_experts: 4}"), "model.num_experts",
         "only for family 'mixtral', not 'qwen'"),
        (("seq_len: 64}", "seq_len: 64, family: olmo2, head_dim: 8}"), "model.head_dim",
         "family 'olmo2' takes its head size from hidden_dim / num_heads"),
    ],
)
def test_registry_validation_names_run_and_field(tmp_path, edit, field, message):
    old, new = edit
    with pytest.raises(RunSpecError) as err:
        load_run_registry(_write(tmp_path, GOOD.replace(old, new)))
    assert err.value.run == "r1"
    assert err.value.field_path == field
    assert message in str(err.value) and "'r1'" in str(err.value)


@pytest.mark.parametrize(
    "resources, parallelism, mesh",
    [
        (ResourceSpec(), ParallelismSpec(), MeshShape(1, 1, 1)),
        # One process: every device a data-parallel replica.
        (ResourceSpec(device_count=8), ParallelismSpec(), MeshShape(8, 1, 1)),
        # A 4-host TPU slice: parameters FSDP-sharded over all 16 chips.
        (ResourceSpec(accelerator="tpu", device_count=16, tpu_type="v5litepod-16"), ParallelismSpec(),
         MeshShape(1, 16, 1)),
        (ResourceSpec(device_count=8), ParallelismSpec(fsdp=4), MeshShape(2, 4, 1)),
        (ResourceSpec(device_count=8), ParallelismSpec(data=2, tensor=2), MeshShape(2, 2, 2)),
        (ResourceSpec(accelerator="gpu", device_count=8), ParallelismSpec(tensor=2), MeshShape(4, 1, 2)),
    ],
)
def test_unset_axes_are_filled_from_the_devices(resources, parallelism, mesh):
    spec = tiny_spec(resources=resources, parallelism=parallelism, train_batch_size=16)
    validate_run(spec)
    assert spec.mesh == mesh and mesh.devices == resources.device_count


@pytest.mark.parametrize(
    "resources, parallelism, field, message",
    [
        ("{device_count: 8}", "{data: 3}", "parallelism.data", "3 does not divide resources.device_count=8"),
        ("{device_count: 8}", "{data: 2, fsdp: 2}", "parallelism", "= 4 devices, but resources.device_count is 8"),
        ("{device_count: 8}", "{tensor: 3}", "parallelism.tensor", "does not divide resources.device_count=8"),
        ("{device_count: 8}", "{fsdp: 8}", "parallelism.fsdp", "does not divide model.hidden_dim=36"),
        ("{device_count: 16}", "{}", "train_batch_size", "8 is not divisible by data 16 x fsdp 1"),
        ("{device_count: 4}", "{tensor: 4}", "parallelism.tensor", "does not divide model.num_kv_heads=2"),
        ("{accelerator: tpu, tpu_type: v5litepod-12, device_count: 12}", "{}", "resources.tpu_type",
         "not a slice size"),
    ],
)
def test_parallelism_that_does_not_fit_the_devices_is_refused(tmp_path, resources, parallelism, field, message):
    body = GOOD.replace("hidden_dim: 32", "hidden_dim: 36").replace(
        "num_train_steps: 10", f"num_train_steps: 10\n    resources: {resources}\n    parallelism: {parallelism}")
    with pytest.raises(RunSpecError) as err:
        load_run_registry(_write(tmp_path, body))
    assert (err.value.run, err.value.field_path) == ("r1", field)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow  # a `marin` process loading the code location
def test_cli_refuses_a_bad_runs_file_in_one_line_with_exit_code_2(tmp_path):
    import os
    import subprocess
    import sys

    runs = _write(tmp_path, GOOD.replace("num_train_steps: 10",
                                         "num_train_steps: 10\n    resources: {device_count: 8}\n"
                                         "    parallelism: {data: 3}"))
    env = {**os.environ, "MARIN_RUNS": str(runs), "MARIN_PREFIX": str(tmp_path / "store"),
           "DAGSTER_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "status"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"marin: {runs}: run 'r1': field 'parallelism.data': 3 does not divide resources.device_count=8 / tensor=1")


def test_an_evaluation_of_a_multi_process_cpu_run_is_one_process_with_all_its_devices():
    two = ResourceSpec(device_count=8, processes=2)
    assert (two.process_count, two.for_evaluation().process_count, two.for_evaluation().device_count) == (2, 1, 8)
    tpu = ResourceSpec(accelerator="tpu", device_count=16, tpu_type="v5litepod-16")
    assert tpu.for_evaluation() == tpu and tpu.process_count == 4


def test_processes_of_a_tpu_slice_are_its_hosts(tmp_path):
    body = GOOD.replace("num_train_steps: 10",
                        "num_train_steps: 10\n    resources: {accelerator: tpu, tpu_type: v5litepod-16, "
                        "device_count: 16, processes: 2}")
    with pytest.raises(RunSpecError, match="v5litepod-16 has 4 hosts, one process each, not 2") as err:
        load_run_registry(_write(tmp_path, body))
    assert err.value.field_path == "resources.processes"
