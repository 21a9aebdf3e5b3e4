import dataclasses

import pytest

from marin_assets.training.spec import (
    ResourceSpec,
    RunSpecError,
    load_run_registry,
)

from conftest import tiny_spec


def test_fingerprint_ignores_resources_but_not_identity_fields():
    base = tiny_spec()
    on_tpu = dataclasses.replace(base, resources=ResourceSpec(accelerator="tpu", device_count=8, tpu_type="v5litepod-8", pool="tpu"))
    assert base.fingerprint() == on_tpu.fingerprint()
    assert "resources" not in base.identity()
    # Norm logging is observability: turning it off retrains nothing.
    assert base.fingerprint() == dataclasses.replace(base, watch_every=0).fingerprint()
    assert base.fingerprint() != dataclasses.replace(base, seed=1).fingerprint()
    wider = dataclasses.replace(base, model=dataclasses.replace(base.model, hidden_dim=64))
    assert base.fingerprint() != wider.fingerprint()
    assert len(base.fingerprint()) == 64


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
        (("optimizer: {learning_rate: 0.01}", "optimizer: {learning_rate: 0.01, schedule: step}"), "optimizer.schedule", "not one of"),
        (("hidden_dim: 32", "hidden_dim: 33"), "model.hidden_dim", "not divisible"),
        (("    tokenizer: t\n", ""), "tokenizer", "required field is missing"),
        (("num_train_steps: 10", "num_train_steps: 10\n    resources: {accelerator: tpu}"), "resources.tpu_type", "exactly when"),
        (("num_train_steps: 10", "num_train_steps: 10\n    watch_every: -1"), "watch_every", "must be >= 0"),
    ],
)
def test_registry_validation_names_run_and_field(tmp_path, edit, field, message):
    old, new = edit
    with pytest.raises(RunSpecError) as err:
        load_run_registry(_write(tmp_path, GOOD.replace(old, new)))
    assert err.value.run == "r1"
    assert err.value.field_path == field
    assert message in str(err.value) and "'r1'" in str(err.value)


