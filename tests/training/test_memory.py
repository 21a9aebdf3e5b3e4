"""The per-device memory estimate of a training step, the compute planner, and where they are used
(issue #49: llama_150m at batch 64 asked XLA for 21.42 GB on a 16 GiB v5e chip and nothing warned)."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml
from conftest import SUBPROCESS_ENV, tiny_spec

from marin_assets.training.memory import (
    ACCELERATOR_CROSS_ENTROPY_BLOCK,
    CPU_CROSS_ENTROPY_BLOCK,
    ComputeSettings,
    candidate_settings,
    estimate_memory,
    plan_compute,
    plan_run,
)
from marin_assets.training.spec import (
    ComputeSpec,
    ModelSpec,
    ParallelismSpec,
    ResourceSpec,
    RunSpecError,
    load_run_registry,
    validate_run,
)
from marin_resources.placement import device_memory

GIB = 2**30
V5E = ResourceSpec(accelerator="tpu", device_count=1, tpu_type="v5litepod-1")
V5E_MEMORY = (16 * GIB, "16 GiB per device (v5litepod-1)")
BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_fit.py"
LLAMA_150M = ModelSpec(hidden_dim=512, intermediate_dim=1792, num_layers=6, num_heads=8, num_kv_heads=8, seq_len=1024)
VOCAB = 128_256


def small_tpu_run(**overrides):
    """hidden 64, intermediate 256, 2 layers, 4 heads of 16, seq 128; batch 8 on one v5e chip."""
    model = ModelSpec(hidden_dim=64, intermediate_dim=256, num_layers=2, num_heads=4, num_kv_heads=4, seq_len=128)
    return tiny_spec(model=model, resources=V5E, **overrides)


def llama_150m(batch: int, **overrides):
    return tiny_spec(model=LLAMA_150M, train_batch_size=batch, resources=V5E, **overrides)


def test_the_terms_of_a_checkpointed_step_with_whole_logits_by_hand():
    spec = small_tpu_run()
    vocab = 16_384
    # Parameters: embeddings and head 2 x 16384 x 64; a layer's q, k, v, o 4 x 64 x 64, MLP 3 x 64 x 256,
    # two norms 2 x 64; two layers and the final norm.
    params = 2 * vocab * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 64
    assert params == spec.model.parameter_count(vocab) == 2_228_544
    tokens = 8 * 128
    estimate = estimate_memory(spec, vocab, ComputeSettings(gradient_checkpointing=True, cross_entropy_block_size=None))
    assert estimate.phase == "logits"  # the whole logits are the largest moment
    assert estimate.parameters == 4 * params  # f32 master weights
    assert estimate.optimizer == 8 * params  # Adam's two f32 moments
    assert estimate.compute_weights == 2 * params  # their bf16 copy
    assert estimate.gradients == 2 * vocab * 64  # the head's, in bf16, when the logits' gradient is formed
    # Each layer's bf16 input (2 x 64 bytes a token, 2 layers), the embeddings' and final norm's three
    # [hidden] arrays in f32 and in bf16.
    assert estimate.activations == tokens * (2 * 2 * 64 + 3 * 64 * (4 + 2))
    # [tokens, vocab]: XLA fuses the loss into the head's product; 3 bytes a logit as measured on a TPU.
    assert estimate.logits == tokens * vocab * 3
    assert estimate.layer == 0
    assert estimate.total == sum(estimate.terms().values())


def test_what_each_setting_changes():
    spec = small_tpu_run(train_batch_size=64)

    def estimate(checkpointing=False, block=None, fused=False, **changes):
        run = dataclasses.replace(spec, **changes)
        return estimate_memory(run, 32_768, ComputeSettings(checkpointing, block, fused))

    whole, blocks, fused = estimate(), estimate(block=4096), estimate(block=4096, fused=True)
    assert whole.logits > 3 * blocks.logits and blocks.logits > 10 * fused.logits > 0
    # Without checkpointing every layer's intermediates are saved: the MLP's six [mlp] arrays alone
    # are 6 x 256 bf16 values a token a layer; checkpointing keeps each layer's input only.
    saved, recomputed = estimate(block=512).activations, estimate(True, block=512).activations
    assert saved - recomputed > 64 * 128 * 2 * 6 * 256 * 2
    # Two FSDP shards hold half of each weight (the final norm is replicated), and half the batch.
    sharded = estimate(block=512, resources=dataclasses.replace(V5E, device_count=2, tpu_type="v5litepod-4"),
                       parallelism=ParallelismSpec(data=1, fsdp=2))
    assert sharded.parameters == 4 * ((spec.model.parameter_count(32_768) - 64) // 2 + 64)
    assert sharded.activations == blocks.activations // 2
    # Lion keeps one moment; CPU computes in f32 and holds no bf16 copy of the weights.
    lion = estimate(block=512, optimizer=dataclasses.replace(spec.optimizer, type="lion"))
    assert lion.optimizer == blocks.optimizer // 2
    assert estimate(block=512, resources=ResourceSpec()).compute_weights == 0


def test_plain_attention_saves_every_score_matrix():
    spec = small_tpu_run(compute=ComputeSpec(attention="vanilla"))
    vanilla = estimate_memory(spec, 1024, ComputeSettings(False, 256, attention="vanilla"))
    splash = estimate_memory(spec, 1024, ComputeSettings(False, 256, attention="splash"))
    # Scores and probabilities: 2 x 4 heads x 128 keys, bf16, per token and layer, plus the causal mask.
    assert vanilla.activations - splash.activations >= 8 * 128 * 2 * (2 * 2 * 4 * 128)


def test_the_planner_takes_the_fastest_setting_that_fits():
    """Nothing recomputed and whole logits first; then the loss in blocks; then checkpointing; then both."""
    picks = {batch: plan_compute(llama_150m(batch), VOCAB, *V5E_MEMORY)[0] for batch in (2, 32, 64)}
    assert picks[2] == ComputeSettings(False, None)
    assert picks[32] == ComputeSettings(False, ACCELERATOR_CROSS_ENTROPY_BLOCK)
    assert picks[64] == ComputeSettings(True, ACCELERATOR_CROSS_ENTROPY_BLOCK)
    # Each earlier candidate was over 90% of the chip.
    candidates = candidate_settings(llama_150m(64), VOCAB)
    assert candidates == [ComputeSettings(False, None), ComputeSettings(False, ACCELERATOR_CROSS_ENTROPY_BLOCK),
                          ComputeSettings(True, None), ComputeSettings(True, ACCELERATOR_CROSS_ENTROPY_BLOCK)]
    assert all(estimate_memory(llama_150m(64), VOCAB, c).total > 0.9 * 16 * GIB for c in candidates[:3])
    # The fused loss, where a run allows it, is the TPU's first way to bound the logits.
    fused = llama_150m(32, compute=ComputeSpec(fused_loss="auto"))
    assert plan_compute(fused, VOCAB, *V5E_MEMORY)[0] == ComputeSettings(False, ACCELERATOR_CROSS_ENTROPY_BLOCK,
                                                                         fused_loss=True)


def test_explicit_settings_hold_and_cpu_runs_compute_as_before():
    # An explicit field is never changed, even where another value would fit.
    no_recompute = llama_150m(64, compute=ComputeSpec(gradient_checkpointing=False))
    with pytest.raises(RunSpecError, match="no checkpointing, cross-entropy blocks of 4,096"):
        plan_compute(no_recompute, VOCAB, *V5E_MEMORY)
    whole = llama_150m(2, compute=ComputeSpec(cross_entropy_block_size=None, gradient_checkpointing=True))
    assert plan_compute(whole, VOCAB, *V5E_MEMORY)[0] == ComputeSettings(True, None)
    # CPU: no checkpointing and blocks of 256 whatever the memory, as CPU runs always computed.
    cpu = tiny_spec()
    assert plan_compute(cpu, 512, 2**40, "a lot")[0] == ComputeSettings(False, CPU_CROSS_ENTROPY_BLOCK)
    assert plan_compute(cpu, 512, None, "unknown")[0] == ComputeSettings(False, CPU_CROSS_ENTROPY_BLOCK)
    # A device of unknown memory is not checked and keeps the accelerator default.
    settings, _ = plan_compute(llama_150m(4096), VOCAB, None, "unknown")
    assert settings == ComputeSettings(True, None)
    unknown = plan_run(dataclasses.replace(llama_150m(64), resources=ResourceSpec(accelerator="gpu")), VOCAB,
                       "some-new-gpu")
    assert unknown.device_memory is None and "not checked: the memory of 'some-new-gpu' is not known" in \
        unknown.describe()


def test_a_run_that_fits_no_setting_is_refused_in_one_line():
    with pytest.raises(RunSpecError) as err:
        plan_compute(llama_150m(1024), VOCAB, *V5E_MEMORY)
    message = str(err.value)
    assert "\n" not in message and err.value.field_path == "model"
    assert message.startswith("run 'tiny': field 'model': does not fit its resources: a training step needs about ")
    # The smallest estimate, its largest terms, the setting it was made for, the device's memory.
    terms = r"\((\w+ [\d,.]+, ){2}\w+ [\d,.]+\)"
    assert re.search(rf"needs about [\d,.]+ GiB at the (logits|layers|update) {terms} per device", message), message
    assert "with checkpointing, cross-entropy blocks of 4,096 at batch 1024 x 1024 tokens, vocab 128,256" in message
    assert message.endswith("more than 90% of 16 GiB per device (v5litepod-1)")


def test_device_memory_is_per_device():
    assert device_memory(ResourceSpec(accelerator="gpu", device_count=8), "nvidia-h100-80gb") == \
        (80 * GIB, "80 GiB per device (nvidia-h100-80gb)")
    assert device_memory(V5E, "") == V5E_MEMORY
    host, label = device_memory(ResourceSpec(), "")
    four = device_memory(ResourceSpec(device_count=4), "")
    assert four[0] == host // 4 and four[1] == "1/4 of " + label  # CPU devices share this machine
    assert device_memory(ResourceSpec(accelerator="gpu"), "some-new-gpu") is None


def test_how_a_run_computes_never_enters_its_fingerprint():
    for spec in load_run_registry().values():
        for compute in (ComputeSpec(gradient_checkpointing=True), ComputeSpec(cross_entropy_block_size=None),
                        ComputeSpec(attention="vanilla")):
            assert dataclasses.replace(spec, compute=compute).fingerprint() == spec.fingerprint()
        assert "compute" not in spec.identity()
    assert load_run_registry()["nano-shakespeare"].fingerprint() == \
        "cf19bfbff4fcdf3b6600a50a2a6298bfc784d9f00481744c62c632bea1a1f04e"


@pytest.mark.parametrize(("compute", "field", "problem"), [
    ({"fused_loss": True}, "compute.fused_loss", "the fused loss is a TPU kernel; this run's accelerator is 'cpu'"),
    ({"attention": "splash"}, "compute.attention", "'splash' attention runs on a TPU, not on 'cpu'"),
    ({"cross_entropy_block_size": 0}, "compute.cross_entropy_block_size", "must be positive, null or 'auto'"),
    ({"gradient_checkpointing": "sometimes"}, "compute.gradient_checkpointing",
     "expected a boolean or 'auto', got 'sometimes' (str)"),
    ({"cross_entropy_block_size": True}, "compute.cross_entropy_block_size",
     "expected an integer, 'auto' or null, got True (bool)"),
])
def test_a_bad_compute_setting_is_refused_naming_the_field(tmp_path, compute, field, problem):
    runs = yaml.safe_load(open(tiny_runs_file(tmp_path)).read())
    runs["runs"]["r"]["compute"] = compute
    (tmp_path / "runs.yaml").write_text(yaml.safe_dump(runs))
    with pytest.raises(RunSpecError) as err:
        load_run_registry(tmp_path / "runs.yaml")
    assert err.value.field_path == field and problem in err.value.problem


def tiny_runs_file(tmp_path, **fields):
    run = {"mixture": "m", "tokenizer": "t", "optimizer": {"learning_rate": 0.001}, "train_batch_size": 8,
           "num_train_steps": 10, "model": {"hidden_dim": 32, "intermediate_dim": 64, "num_layers": 2,
                                            "num_heads": 2, "num_kv_heads": 2, "seq_len": 64}, **fields}
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"runs": {"r": run}}))
    return path


def test_compute_settings_are_rendered_into_levanter_config(tmp_path):
    from marin_assets.training.levanter_config import build_train_config

    data = {"configs": {"m": {"cache_dir": "/c"}}, "train_weights": {"m": 1.0}}
    spec = small_tpu_run()
    config = build_train_config(spec, data, "/tok", str(tmp_path), compute=ComputeSettings(False, 4096, True, "splash"))
    assert {k: config["model"][k] for k in ("gradient_checkpointing", "cross_entropy_block_size", "attn_backend")} \
        == {"gradient_checkpointing": False, "cross_entropy_block_size": 4096, "attn_backend": "splash"}
    # Unplanned, as configs were rendered before: checkpointing and whole logits on accelerators ...
    model = build_train_config(spec, data, "/tok", str(tmp_path))["model"]
    assert (model["gradient_checkpointing"], model["cross_entropy_block_size"]) == (True, None)
    assert "attn_backend" not in model
    # ... and on CPU no checkpointing, blocks of 256.
    model = build_train_config(tiny_spec(), data, "/tok", str(tmp_path))["model"]
    assert (model["gradient_checkpointing"], model["cross_entropy_block_size"]) == (False, 256)


def test_deployment_refuses_a_run_too_big_for_its_tpu_before_anything_launches(tmp_path):
    from marin_assets.deployment import Deployment
    from marin_assets.training.spec import DEFAULT_RUNS_YAML
    from marin_resources.environments import MarinSettings

    name, run = next(iter(yaml.safe_load(DEFAULT_RUNS_YAML.read_text())["runs"].items()))
    big = {**run, "train_batch_size": 4096,
           "model": {"hidden_dim": 1024, "intermediate_dim": 3584, "num_layers": 24, "num_heads": 16,
                     "num_kv_heads": 8, "seq_len": 1024},
           "resources": {"accelerator": "tpu", "device_count": 1, "tpu_type": "v5litepod-1"}}
    runs_file = tmp_path / "runs.yaml"
    runs_file.write_text(yaml.safe_dump({"runs": {name: big}}))
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_RUNS": str(runs_file)},
                                      cwd=tmp_path)
    with pytest.raises(RunSpecError) as err:
        Deployment.load(settings)
    assert "does not fit its resources" in str(err.value) and "of 16 GiB per device (v5litepod-1)" in str(err.value)
    runs_file.write_text(yaml.safe_dump({"runs": {name: {**big, "train_batch_size": 8}}}))
    assert name in Deployment.load(settings).runs  # the same model at a batch that fits


def test_the_checkpoint_asset_plans_before_launching_and_records_the_setting(tmp_path, synthetic_deployment):
    from test_init_from import recording_checkpoint_stage

    from marin_assets.training.assets import CHECKPOINT_VERSION

    tpu = {"accelerator": "tpu", "device_count": 1, "tpu_type": "v5litepod-1"}
    big_model = {"hidden_dim": 512, "intermediate_dim": 1792, "num_layers": 6, "num_heads": 8, "num_kv_heads": 8,
                 "seq_len": 1024}
    runs_file = tmp_path / "runs.yaml"
    base = yaml.safe_load(tiny_runs_file(tmp_path).read_text())["runs"]["r"]
    runs_file.write_text(yaml.safe_dump({"runs": {
        "cpu": base,
        "tpu": {**base, "resources": tpu, "model": big_model, "train_batch_size": 256},
        "huge": {**base, "resources": tpu, "model": big_model, "train_batch_size": 4096}}}))
    # Deployment.load would refuse "huge" when the runs file is read; this stage is built without it.
    checkpoint, _, resources, store, calls = recording_checkpoint_stage(tmp_path, runs_file, synthetic_deployment)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("runs", ["cpu", "tpu", "huge"])
        for run in ("cpu", "tpu"):
            assert dg.materialize([checkpoint], partition_key=run, instance=instance, resources=resources).success
        [(_, cpu_config), (tpu_process, tpu_config)] = calls
        assert (cpu_config["model"]["gradient_checkpointing"], cpu_config["model"]["cross_entropy_block_size"]) == \
            (False, CPU_CROSS_ENTROPY_BLOCK)
        # llama_150m's shape (vocabulary 32,768) at batch 256 on one v5e chip: the planner's pick is what
        # the config computes ...
        assert (tpu_config["model"]["gradient_checkpointing"], tpu_config["model"]["cross_entropy_block_size"]) == \
            (True, ACCELERATOR_CROSS_ENTROPY_BLOCK)
        assert "--fused-loss" not in tpu_process.args
        # ... and what the manifest records, outside the fingerprint.
        manifest = store.find("checkpoint", CHECKPOINT_VERSION, "tpu")
        recorded = manifest.metrics["compute"]
        assert {k: recorded[k] for k in ("gradient_checkpointing", "cross_entropy_block_size", "fused_loss",
                                         "attention")} == \
            {"gradient_checkpointing": True, "cross_entropy_block_size": 4096, "fused_loss": False, "attention": None}
        assert recorded["device_memory_bytes"] == 16 * GIB and 0 < recorded["memory_estimate_bytes"] < 16 * GIB
        assert "compute" not in manifest.config
        assert manifest.fingerprint == load_run_registry(runs_file)["tpu"].fingerprint()

        failed = dg.materialize([checkpoint], partition_key="huge", instance=instance, resources=resources,
                                raise_on_error=False)
        assert not failed.success and len(calls) == 2  # refused before any process started
        [failure] = [e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"]
        message = failure.event_specific_data.error.message
        assert "checkpoint[huge]: run 'huge': field 'model': does not fit its resources" in message
        assert store.find("checkpoint", CHECKPOINT_VERSION, "huge") is None


def test_the_validated_spec_accepts_every_compute_setting_on_its_accelerator():
    spec = llama_150m(16, compute=ComputeSpec(gradient_checkpointing=True, cross_entropy_block_size=8192,
                                               attention="splash", fused_loss=True))
    validate_run(spec)


def test_the_benchmark_sets_the_estimate_beside_xlas_compiled_memory_analysis():
    """benchmarks/memory_fit.py lowers Levanter's real train step without running it; on CPU, in f32, the
    estimate of the tiny shape is within a quarter of XLA's peak (docs/training.md, "Memory")."""
    out = subprocess.run([sys.executable, str(BENCHMARK), "--shape", "tiny", "--batch", "4",
                          "--checkpointing", "off", "--ce-block", "none"], capture_output=True, text=True,
                         env={**os.environ, **SUBPROCESS_ENV}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["settings"] == {"gradient_checkpointing": False, "cross_entropy_block_size": None,
                                  "fused_loss": False, "attention": None}
    xla = result["xla"]
    assert xla["peak"] == xla["argument"] + xla["output"] - xla["alias"] + xla["temp"] > 0
    assert 0.8 < result["estimate_over_xla"] < 1.25


def test_xlas_refusal_of_a_program_over_the_chip_gives_its_figure():
    spec = importlib.util.spec_from_file_location("memory_fit", BENCHMARK)
    benchmark = sys.modules["memory_fit"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    out_of_memory_figures = benchmark.out_of_memory_figures
    refusal = ("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
               "for HLO temporaries (21.39G) exceeds available HBM (15.75G).")
    figures = out_of_memory_figures(refusal, argument_bytes=GIB)
    assert figures == {"out_of_memory": 1, "argument": GIB, "temp": int(21.39 * GIB), "peak": GIB + int(21.39 * GIB)}
    assert out_of_memory_figures("INTERNAL: something else", argument_bytes=GIB) is None
