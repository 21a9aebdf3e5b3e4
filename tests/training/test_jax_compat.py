"""Levanter and haliax on a newer JAX (marin_assets/training/jax_compat.py): each place where JAX 0.10
breaks them, driven through the Levanter code that broke. Under JAX 0.10 each test first shows the
breakage without its fix, then the fix; under the locked 0.7.2 Levanter runs unfixed and gives the
same values. .ci/run runs these (-m jax_compat) under both JAX versions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from marin_assets.training import jax_compat

pytestmark = pytest.mark.jax_compat

NEWER_JAX = "JAX past 0.7 (install() applies fix_cpu_mesh and fix_stack_tree there)"


def newer_jax() -> bool:
    import jax

    return jax.__version_info__ >= (0, 8)


@pytest.fixture
def levanter_restored():
    """The fixes are process-wide: put back what they replace once the test is done."""
    import haliax.nn.loss
    from levanter.data import loader
    from levanter.utils import jax_utils

    (cell,) = jax_utils.local_cpu_mesh.__closure__
    saved = haliax.nn.loss.maybe_reduce_loss, loader.stack_tree, cell.cell_contents
    yield
    haliax.nn.loss.maybe_reduce_loss, loader.stack_tree, cell.cell_contents = saved


def test_install_applies_the_fixes_this_jax_needs_and_touches_no_device():
    # A fresh process: install() runs once per process, and must leave JAX's backends alone so that
    # jax.distributed can still start after it.
    code = ("import json; from marin_assets.training import jax_compat; from jax._src import xla_bridge\n"
            "print(json.dumps([jax_compat.install(), xla_bridge.backends_are_initialized()]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    fixes, backends_up = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = (["fix_loss_mask"] if jax_compat.float_where_refused() else []) + \
        (["fix_cpu_mesh", "fix_stack_tree"] if newer_jax() else [])
    assert fixes == expected and not backends_up


@pytest.mark.parametrize("block_size", [None, 8], ids=["whole-vocab", "blockwise"])
def test_3a_a_float_loss_mask_gives_the_masked_mean(levanter_restored, block_size):
    """Levanter's loss mask is float 0/1; JAX 0.10's jnp.mean refuses a float where= in haliax's
    maybe_reduce_loss. The fix reads it as JAX 0.7 did (nonzero = counted): the same mean."""
    import haliax as hax
    import jax
    from levanter.models.loss import maybe_fused_next_token_loss

    Batch, Pos = hax.Axis("batch", 2), hax.Axis("position", 6)
    Embed, Vocab = hax.Axis("embed", 4), hax.Axis("vocab", 16)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    embeddings = hax.random.normal(keys[0], (Batch, Pos, Embed))
    lm_head = hax.random.normal(keys[1], (Embed, Vocab))
    targets = hax.random.randint(keys[2], (Batch, Pos), 0, Vocab.size)
    mask_values = np.ones((2, 6), np.float32)
    mask_values[:, -1] = 0  # the causal mask's last position
    mask_values[1, :2] = 0  # and a prompt
    mask = hax.named(mask_values, (Batch, Pos))

    def loss(reduction):
        return maybe_fused_next_token_loss(Pos, Embed, Vocab, embeddings, lm_head, targets, loss_mask=mask,
                                           reduction=reduction, block_size=block_size)

    per_token = np.asarray(loss(None).array, np.float64)
    masked_mean = (per_token * mask_values).sum() / mask_values.sum()
    if jax_compat.float_where_refused():
        with pytest.raises(ValueError, match="where must be None or a boolean array"):
            loss(hax.mean)
    else:
        assert float(loss(hax.mean).array) == pytest.approx(masked_mean, rel=1e-6)
    jax_compat.fix_loss_mask()
    assert float(loss(hax.mean).array) == pytest.approx(masked_mean, rel=1e-6)


def _evaluation_batch_script() -> str:
    """The first batch of Levanter's loader over a DomainTaggedDataset built under the training mesh, on
    every device there is, as train_lm builds its evaluator (the examples themselves come from the token
    cache, off any mesh). Prints the batch's first tokens, or the error's first line."""
    return textwrap.dedent("""
        import sys
        import haliax as hax, jax, jax.numpy as jnp, numpy as np
        from haliax.partitioning import ResourceAxis
        from levanter.data.dataset import ListAsyncDataset
        from levanter.data.loader import DataLoader
        from levanter.eval import DomainTaggedDataset
        from levanter.models.lm_model import LmExample
        from levanter.utils.jax_utils import create_fsdp_mesh
        from marin_assets.training import jax_compat

        for fix in sys.argv[1:]:
            getattr(jax_compat, fix)()
        Pos = hax.Axis("position", 8)
        rows = np.arange(4 * 8, dtype=np.int32).reshape(4, 8)
        sets = [(ListAsyncDataset([LmExample.causal(hax.named(row, Pos)) for row in rows], is_complete=True), [tag])
                for tag in ("docs", "code")]
        mesh = create_fsdp_mesh(1, jax.device_count(), 1)  # as Levanter's trainer makes it
        with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"batch": ResourceAxis.DATA}):
            loader = DataLoader(DomainTaggedDataset(sets), 2, mesh=mesh, axis_resources={"batch": ResourceAxis.DATA})
            try:
                examples, tags = next(iter(loader))
            except ValueError as exc:
                print("error:", str(exc).splitlines()[0])
                raise SystemExit(1)
        print(np.asarray(examples.tokens.array)[:, 0].tolist())
    """)


def _evaluation_batch(*fixes: str, devices: int) -> subprocess.CompletedProcess:
    # A fresh process: its device count is fixed when JAX starts, and the fixes are process-wide.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.run([sys.executable, "-c", _evaluation_batch_script(), *fixes], capture_output=True,
                          text=True, timeout=300, env=env)


def test_3b_the_loaders_cpu_mesh_stacks_examples_built_under_the_training_mesh(levanter_restored):
    """JAX 0.10's make_mesh gives local_cpu_mesh Explicit axes; the examples carry the training mesh's Auto
    axes, and stack_tree refuses the mix. In this process (one CPU device)."""
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from haliax.partitioning import ResourceAxis
    from jax.sharding import Mesh
    from levanter.data.dataset import ListAsyncDataset
    from levanter.data.loader import DataLoader
    from levanter.models.lm_model import LmExample

    Pos = hax.Axis("position", 8)
    # Levanter's training mesh (create_fsdp_mesh's axes, Auto), on one device whatever this process has.
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), (ResourceAxis.REPLICA, ResourceAxis.DATA,
                                                               ResourceAxis.MODEL))
    rows = np.arange(4 * 8, dtype=np.int32).reshape(4, 8)

    def first_batch():
        with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"batch": ResourceAxis.DATA}):
            examples = [LmExample.causal(hax.named(jnp.asarray(row), Pos)) for row in rows]
            loader = DataLoader(ListAsyncDataset(examples, is_complete=True), 2, mesh=mesh,
                                axis_resources={"batch": ResourceAxis.DATA})
            return np.asarray(next(iter(loader)).tokens.array)

    if newer_jax():
        with pytest.raises(ValueError, match="context mesh .*Explicit.* should match the aval mesh"):
            first_batch()
    else:
        np.testing.assert_array_equal(first_batch(), rows[:2])
    jax_compat.fix_cpu_mesh()
    np.testing.assert_array_equal(first_batch(), rows[:2])


def test_3c_evaluation_examples_on_the_training_devices_are_stacked_on_the_cpu():
    """Eval's tag arrays, made under a training mesh of two devices, live on both (on a TPU host: on the
    chip), and the jitted stack_tree under the one-CPU-device mesh refuses them."""
    fixed = _evaluation_batch("fix_cpu_mesh", "fix_stack_tree", devices=2)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert fixed.stdout.split()[-2:] == ["[0,", "8]"]
    unfixed = _evaluation_batch("fix_cpu_mesh", devices=2)  # the other fix for this path in place
    if newer_jax():
        assert unfixed.returncode == 1 and "error: Received incompatible devices for jitted computation" in \
            unfixed.stdout, unfixed.stdout + unfixed.stderr[-3000:]
    else:
        assert unfixed.returncode == 0 and unfixed.stdout == fixed.stdout, unfixed.stderr[-3000:]


@pytest.mark.parametrize("fix, module, name, replacement", [
    ("fix_loss_mask", "haliax.nn.loss", "maybe_reduce_loss", lambda arr, reduction, where: arr),
    ("fix_stack_tree", "levanter.data.loader", "stack_tree", lambda batch_name, datums, pad: datums),
    ("fix_cpu_mesh", "levanter.utils.jax_utils", "local_cpu_mesh", lambda: None),
])
def test_a_changed_levanter_function_is_refused_in_one_line(monkeypatch, fix, module, name, replacement):
    import importlib

    monkeypatch.setattr(importlib.import_module(module), name, replacement)
    with pytest.raises(jax_compat.JaxCompatError) as refused:
        getattr(jax_compat, fix)()
    assert name in str(refused.value) and "\n" not in str(refused.value)


# The training process as a one-chip TPU host starts it, on CPU: the host names itself the TPU VM's one
# worker (TPU_WORKER_HOSTNAMES=localhost), JAX's cluster detection takes that for a TPU cluster, and
# jax.distributed cannot start (the backend is up by then, and the host allows no sockets).
AS_ON_A_TPU_HOST = """
import sys
import jax
from jax._src.clusters import cloud_tpu_cluster

cloud_tpu_cluster.running_in_cloud_tpu_vm = True


def refuse(*args, **kwargs):
    raise RuntimeError("jax.distributed.initialize() must be called before any JAX computations are executed")


jax.distributed.initialize = refuse
from levanter.distributed import DistributedConfig

assert DistributedConfig()._is_distributed(), "Levanter no longer takes this environment for a TPU cluster"
import importlib

importlib.import_module(sys.argv[1]).main(sys.argv[2:])  # the process's module (train_main, export_main)
"""


@pytest.mark.slow
def test_a_tiny_run_trains_evaluates_and_exports_as_on_a_tpu_host(tmp_path, tiny_artifact, tiny_mixture):
    """The whole training process on this JAX, with every fix where it is needed (the loss mask at the
    first step, the loader's CPU mesh, the evaluation batches of a mesh of two devices), then the final
    evaluation (eval_main's code) in the same process; in a TPU host's environment, which must start no
    jax.distributed for one process."""
    from conftest import SUBPROCESS_ENV, tiny_spec

    from marin_assets.training.commands import export_command, train_command
    from marin_assets.training.levanter_config import build_train_config, write_train_config
    from marin_assets.training.spec import ResourceSpec
    from marin_resources.launchers import build_command_and_env

    spec = tiny_spec(steps=4, steps_per_eval=2, resources=ResourceSpec(device_count=2))
    config = write_train_config(build_train_config(spec, tiny_mixture, tiny_artifact[1], str(tmp_path)),
                                tmp_path / "train_config.yaml")
    command = train_command(config, str(tmp_path), final_eval=True, final_eval_examples=16)
    launch = build_command_and_env(command, accelerator="cpu", cpu_devices=2)
    python, module = launch.command[:2], launch.command[2:]
    assert launch.command[1:3] == ["-m", "marin_assets.training.train_main"]
    env = {**os.environ, **SUBPROCESS_ENV, **launch.env, "TPU_WORKER_HOSTNAMES": "localhost"}
    proc = subprocess.run([python[0], "-c", AS_ON_A_TPU_HOST, *module], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert (summary["final_step"], summary["device_count"], summary["process_count"]) == (4, 2, 1)
    assert summary["train_loss_last"] < summary["train_loss_first"] and summary["eval_loss_last"] > 0
    report = json.loads((tmp_path / "final_eval_report.json").read_text())
    assert report["eval/stdlib-docs/loss"] == pytest.approx(summary["eval_loss_last"], rel=0.05)

    # The export process on the same two devices: its check reads validation examples, which Levanter
    # builds on the CPU device; under the run's mesh JAX 0.10 refused them (seen on the TPU host).
    export = build_command_and_env(export_command(config, str(tmp_path / "hf")), accelerator="cpu", cpu_devices=2)
    proc = subprocess.run([export.command[0], "-c", AS_ON_A_TPU_HOST, *export.command[2:]],
                          env={**env, **export.env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = json.loads((tmp_path / "hf" / "export_report.json").read_text())
    assert exported["client_check"] == "transformers FlaxLlamaForCausalLM" and exported["greedy_matches"]
