"""Training process: runs Levanter's ``train_lm.main`` unchanged and streams its metrics out.

Usage: ``python -m marin_assets.training.train_main --config OUTPUT_DIR/train_config.yaml``

How we hook in: ``train_lm.main`` builds its ``Trainer`` internally and does not expose it, but
every metric it produces (``train/loss``, ``throughput/*``, ``eval/*``, ``parameter_count``)
flows through the trackers configured in ``trainer.tracker``. We prepend one more tracker, a
small Levanter ``Tracker`` that groups each step's values into one record, appends it to
``{output_dir}/metrics.jsonl``, adds an MFU estimate and forwards it through Dagster Pipes.
So Levanter's training loop runs verbatim; there is no copy of ``train_lm.main`` to keep in sync.

Final evaluation (``--final-eval``): once training has finished, the process evaluates the final
checkpoint with ``eval_main.evaluate_checkpoint`` while Levanter and JAX are loaded and writes
``{output_dir}/final_eval_report.json``; eval/<run> adopts that report instead of starting a
process of its own (for a small run, the second process cost as much as its training steps).

Resume: the config points Levanter's checkpointer at ``{output_dir}/checkpoints``, or, when the
store is a bucket, at the artifact's ``checkpoints/`` there (tensorstore writes each step straight
to the bucket); Levanter loads the latest ``step-N`` on start, so relaunching after a crash or
``kill -9``, on this machine or a fresh one, continues.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from marin_assets.training.accelerator import sole_process
from marin_assets.training.init_weights import InitWeightsError, check_weights, stage_weights, uri_of_reference
from marin_assets.training.levanter_config import trained_components
from marin_assets.training.metrics import (
    median,
    mfu,
    peak_flops_total,
    plot_loss_curve,
    read_metrics,
    training_flops_per_token,
)
from marin_assets.training.process import exits_when_held, input_errors, parse_process_args, process_parser
from marin_assets.training.reporting import Reporter, open_reporter
from marin_assets.training.spec import HEAD_DIM_FAMILIES, ModelSpec
from marin_resources.placement import ProcessGroup
from marin_resources.progress import Throttle, eta, progress_line
from scaling.flops import MIXTURE_OF_EXPERTS_FAMILIES

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "train_summary.json"
FINAL_EVAL_FILE = "final_eval_report.json"
LOSS_CURVE_FILE = "loss_curve.png"
INPUT_ERROR_FILE = "train_input_error.txt"
"""Written instead of training when the input is wrong (the initial weights): the one line the asset reports."""
COORDINATOR_TIMEOUT_ENV = "MARIN_COORDINATOR_TIMEOUT_S"
DEFAULT_COORDINATOR_TIMEOUT_S = 300.0
# A process silent this long is taken for dead and the whole job stops (JAX's default: 100 s).
HEARTBEAT_TIMEOUT_S = 20
# Per-step values copied from Levanter's log calls into metrics.jsonl, under our names.
_LEVANTER_KEYS = {
    "train/loss": "loss",
    "throughput/tokens_per_second": "tokens_per_second",
    "throughput/duration": "step_seconds",
    "throughput/total_tokens": "total_tokens",
    "throughput/loading_time": "loading_seconds",
    "optim/learning_rate": "learning_rate",
    # A mixture of experts' router losses (already inside "loss"), as `_returning_logged_metrics` returns them.
    "train/load_balancing_loss": "load_balancing_loss",
    "train/router_z_loss": "router_z_loss",
}
# Steps whose timing includes XLA compilation (the first step, and the step where the
# eval/jit-hook variant of the train step first runs) are excluded from throughput summaries.
_WARMUP_STEPS = 2


class StepMetricsSink:
    """Collects the metrics Levanter logs for one step and writes them as one record when the step changes."""

    def __init__(
        self,
        metrics_path: Path,
        reporter: Reporter,
        flops_per_token: float,
        attempt: int,
        report_every: int,
        total_steps: int,
    ):
        self.metrics_path = metrics_path
        self.reporter = reporter
        self.flops_per_token = flops_per_token
        self.attempt = attempt
        self.report_every = report_every
        self.total_steps = total_steps
        # The first step recorded in this attempt and when: the ETA's rate leaves start-up and compilation out.
        self._first: tuple[int, float] | None = None
        self._throttle = Throttle()
        self.summary: dict[str, Any] = {}
        self.wandb_run_dir: str | None = None
        self._step: int | None = None
        self._values: dict[str, Any] = {}
        self._peak_flops_total: float | None = None
        self._device_kind: str | None = None
        self.last_finite: tuple[int, float] | None = None
        self._file = open(metrics_path, "a")

    def _hardware(self) -> None:
        import jax

        if self._device_kind is None:
            self._device_kind = jax.devices()[0].device_kind
            self._peak_flops_total = peak_flops_total(self._device_kind, jax.device_count(), jax.process_count())
            self.summary.setdefault("device_kind", self._device_kind)
            self.summary.setdefault("device_count", jax.device_count())
            self.summary.setdefault("process_count", jax.process_count())
            self.summary.setdefault("peak_flops_total", self._peak_flops_total)

    def log(self, metrics: dict[str, Any], step: int | None) -> None:
        if step is None:
            return
        if self._step is not None and step != self._step:
            self.flush()
        self._step = step
        for key, value in metrics.items():
            if key in _LEVANTER_KEYS:
                self._values[_LEVANTER_KEYS[key]] = _to_python(value)
            elif key.startswith("eval/") and (key.endswith("/loss") or key.endswith("/bpb")):
                self._values[key] = _to_python(value)

    def log_summary(self, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            self.summary[key] = _to_python(value)

    def pending(self) -> dict[str, Any] | None:
        """The record of the step still being logged (its loss is in, later values such as throughput may
        not be): what a checkpoint of that step, saved now, must not lose."""
        if self._step is None or "loss" not in self._values:
            return None
        return {"step": self._step, "attempt": self.attempt, **self._values}

    def flush(self) -> None:
        if self._step is None or "loss" not in self._values:
            self._step, self._values = None, {}
            return
        self._hardware()
        record: dict[str, Any] = {"step": self._step, "attempt": self.attempt, **self._values}
        tps = record.get("tokens_per_second")
        record["mfu"] = (
            mfu(tps, self.flops_per_token, self._peak_flops_total) if tps and self._peak_flops_total else None
        )
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if math.isfinite(record["loss"]):
            self.last_finite = (self._step, record["loss"])
        now = time.monotonic()
        self._first = self._first or (self._step, now)
        # Every report_every steps, and at least every EMIT_EVERY_S: the CLI shows the newest line.
        if self._throttle.due() or self._step % self.report_every == 0:
            self.reporter.custom_message({"kind": "train_step", **record})
            left = eta(self._step - self._first[0], self.total_steps - self._first[0], now - self._first[1])
            self.reporter.log(progress_line(
                f"step {self._step}/{self.total_steps} loss {record['loss']:.4f} tokens/s {tps or 0:.0f}"
                + (f" mfu {record['mfu']:.2%}" if record["mfu"] is not None else "") + (f" {left}" if left else "")))
        self._step, self._values = None, {}

    def divergence(self) -> str:
        """One line for a run whose loss became NaN after the steps logged so far."""
        last = self.last_finite
        pending = self.pending()  # the step logged last, not yet written: its loss came before the NaN
        if pending is not None and math.isfinite(pending["loss"]):
            last = (pending["step"], pending["loss"])
        where = "at its first step" if last is None else f"after step {last[0]} (loss {last[1]:.4f} there)"
        return (f"training diverged: the loss became NaN {where}; lower optimizer.learning_rate, lengthen "
                "optimizer.warmup or set optimizer.max_grad_norm, and run again")

    def capture_wandb_dir(self) -> None:
        try:
            import wandb
        except ImportError:
            return
        if wandb.run is not None:
            self.wandb_run_dir = os.path.dirname(wandb.run.dir)  # run.dir is .../<run>/files

    def close(self) -> None:
        self.flush()
        self._file.close()


def _to_python(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    return value


_SINKS: dict[str, StepMetricsSink] = {}
_TRACKER_CONFIG_CLASS: type | None = None


def _metrics_tracker_config_class() -> type:
    """Define and register (once) the Levanter tracker that feeds a StepMetricsSink.

    Defined lazily so that importing this module never imports Levanter.
    """
    global _TRACKER_CONFIG_CLASS
    if _TRACKER_CONFIG_CLASS is not None:
        return _TRACKER_CONFIG_CLASS
    from levanter.tracker import Tracker, TrackerConfig

    class StepMetricsTracker(Tracker):
        name = "marin_step_metrics"

        def __init__(self, sink: StepMetricsSink):
            self.sink = sink

        def log_hyperparameters(self, hparams):
            pass

        def log(self, metrics, *, step, commit=None):
            self.sink.log(dict(metrics), step)

        def log_summary(self, metrics):
            self.sink.log_summary(dict(metrics))

        def log_artifact(self, artifact_path, *, name=None, type=None):
            pass

        def finish(self):
            # Runs before the W&B tracker's finish (we are first in the tuple), while wandb.run is live.
            self.sink.capture_wandb_dir()
            self.sink.flush()

    @TrackerConfig.register_subclass("marin_step_metrics")
    @dataclasses.dataclass
    class StepMetricsTrackerConfig(TrackerConfig):
        sink_key: str = ""

        def init(self, run_id):
            # Levanter initialises trackers twice (global and per-Trainer); both must share the sink.
            return StepMetricsTracker(_SINKS[self.sink_key])

    _TRACKER_CONFIG_CLASS = StepMetricsTrackerConfig
    return StepMetricsTrackerConfig


def _final_checkpoint_trainer_class(before_save: Callable[[], None] | None = None,
                                    after_train: Callable[[Any], None] | None = None) -> type:
    """Levanter's Trainer, plus a guaranteed checkpoint of the final step.

    ``Trainer.train`` ends with ``run_hooks(force=True)``, but plain-function hooks drop ``force``,
    so the checkpointer only saves the last step if it happens to fall on the ``keep`` cadence or
    the time interval; and ``train_lm.main`` does not wait for the async write before exiting.
    Eval and downstream stages need the final weights, so after training we save (if needed)
    and wait with the same checkpointer instance Levanter created. ``before_save`` runs as each
    checkpoint save begins; ``after_train`` gets the trained model, as its devices hold it.
    """
    from levanter.checkpoint import Checkpointer
    from levanter.trainer import Trainer

    class FinalCheckpointTrainer(Trainer):
        _marin_checkpointer: Checkpointer | None = None

        def __init__(self, config, optimizer, loss_fn, **kwargs):
            super().__init__(config, optimizer, _returning_logged_metrics(loss_fn), **kwargs)

        def add_hook(self, fn=None, *, every: int = 1):
            if isinstance(getattr(fn, "__self__", None), Checkpointer):
                self._marin_checkpointer = checkpointer = fn.__self__
                if before_save is not None:
                    save = checkpointer.save_checkpoint

                    def save_checkpoint(*args, **kwargs):
                        before_save()
                        return save(*args, **kwargs)

                    checkpointer.save_checkpoint = save_checkpoint
            return super().add_hook(fn, every=every)

        def train(self, state, train_loader):
            info = super().train(state, train_loader)
            if after_train is not None:
                after_train(info.state.model)
            checkpointer = self._marin_checkpointer
            if checkpointer is not None:
                checkpointer.wait_until_finished()
                final = os.path.join(checkpointer.base_path, f"step-{info.step}", "metadata.json")
                # A save is collective: every process must take the same branch, so process 0's look decides.
                if not _agreed(_exists(final)):
                    checkpointer.on_step(info, force=True)
                    checkpointer.wait_until_finished()
            return info

    return FinalCheckpointTrainer


def _returning_logged_metrics(loss_fn: Callable) -> Callable:
    """``loss_fn`` with what the model logs while it runs (``levanter.tracker.jit_log``, as Mixtral
    does with its router statistics) returned among the loss's metrics. Logged directly, through
    an io_callback, they would fail the gradient, which cannot differentiate a callback; returned,
    Levanter logs them with the step's other ``train/`` metrics."""
    import levanter.tracker

    def loss_and_logged_metrics(*args, **kwargs):
        with levanter.tracker.defer_tracker_for_jit() as logged:
            result = loss_fn(*args, **kwargs)
        loss, metrics = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
        return loss, {**{name.removeprefix("train/"): value for name, value in logged.items()}, **metrics}

    return loss_and_logged_metrics


def _agreed(flag: bool) -> bool:
    """``flag`` as process 0 sees it, on every process of a multi-process job."""
    import jax

    if not jax.distributed.is_initialized():  # one process (and no device touched before Levanter sets JAX up)
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


class TrainingDiverged(RuntimeError):
    """The loss became NaN: Levanter stops the run; the message is one line for the user."""


LEVANTER_NAN_LOSS = "Loss is NaN"
"""What Levanter's Trainer raises (a RuntimeError) when a step's loss is NaN."""


class CoordinatorUnreachable(RuntimeError):
    """Process 0 of a multi-process job did not start its coordination service in time."""


def join_process_group(group: ProcessGroup, timeout_s: float) -> None:
    """Join ``group`` through ``jax.distributed`` (before JAX touches a device), waiting at most
    ``timeout_s`` for the coordinator.

    JAX's own wait ends the process with a fatal log (no exception) once its timeout passes, so the
    other processes first wait for process 0's port themselves and fail in one line when it never opens.
    """
    import jax

    if group.process_id != 0:
        host, port = group.coordinator_address.rsplit(":", 1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise CoordinatorUnreachable(
                        f"the coordinator at {group.coordinator_address} did not come up within {timeout_s:g} s "
                        f"(process {group.process_id} of {group.process_count})") from None
                time.sleep(0.2)
    jax.distributed.initialize(group.coordinator_address, group.process_count, group.process_id,
                               initialization_timeout=max(1, int(timeout_s)),
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)


def _exists(path: str) -> bool:
    import fsspec

    fs, plain = fsspec.core.url_to_fs(path)
    return fs.exists(plain)


def largest_weight_sharding(model) -> dict[str, Any]:
    """How the model's largest weight matrix lies on the devices: its path, named axes, the mesh
    axes each array dimension is split over (the PartitionSpec) and the shape one device holds.

    The evidence that a run is sharded as asked: with FSDP the embed dimension's entry is the mesh's
    ``data`` axis and each device holds 1/fsdp of it; on a pure data-parallel mesh every entry is
    None and each device holds the whole matrix.
    """
    import haliax as hax
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(model, is_leaf=lambda x: isinstance(x, hax.NamedArray))
    path, weight = max(((p, leaf) for p, leaf in leaves if isinstance(leaf, hax.NamedArray) and leaf.ndim >= 2),
                       key=lambda item: item[1].size)
    array = weight.array
    spec = list(array.sharding.spec) + [None] * (array.ndim - len(array.sharding.spec))
    return {
        "path": jax.tree_util.keystr(path),
        "axes": {axis.name: axis.size for axis in weight.axes},
        "partition_spec": [entry if entry is None or isinstance(entry, str) else list(entry) for entry in spec],
        "device_shape": list(array.sharding.shard_shape(array.shape)),
        "devices": len(array.sharding.device_set),
    }


def mesh_axis_sizes(trainer_config) -> dict[str, int]:
    """The mesh Levanter built, in the run spec's terms (after it initialized JAX)."""
    return {"mesh_data": trainer_config.replica_axis_size,
            "mesh_fsdp": trainer_config.data_ici_axis_size * trainer_config.data_dcn_axis_size,
            "mesh_tensor": trainer_config.model_axis_size}


def model_spec_from_levanter(model_config) -> ModelSpec:
    """The run spec's model for a parsed Levanter model config (its family is the config's registered name)."""
    from levanter.models.lm_model import LmConfig

    family = LmConfig.get_choice_name(type(model_config))
    moe = family in MIXTURE_OF_EXPERTS_FAMILIES
    return ModelSpec(
        hidden_dim=model_config.hidden_dim,
        intermediate_dim=model_config.intermediate_dim,
        num_layers=model_config.num_layers,
        num_heads=model_config.num_heads,
        num_kv_heads=model_config.num_kv_heads,
        seq_len=model_config.seq_len,
        head_dim=model_config.head_dim if family in HEAD_DIM_FAMILIES else None,
        tie_word_embeddings=model_config.tie_word_embeddings,
        family=family,
        num_experts=model_config.n_routed_experts if moe else None,
        experts_per_token=model_config.num_experts_per_tok if moe else None,
    )


def check_caches_readable(data_config) -> None:
    """Fail early, with a clear message, if a cache cannot be read or lacks a field Levanter will ask for.

    Levanter opens caches with the fields the tokenizer returns (e.g. ``token_type_ids`` for some
    HF tokenizers); a mismatch otherwise surfaces as a bare AssertionError deep in the loader. A
    cache whose ledger is there but whose arrays are not (tensorstore could not see them) is a
    store problem, and is reported as one.
    """
    import fsspec
    import numpy as np
    from levanter.store.cache import TreeCache

    fields = sorted(data_config.the_tokenizer("hi there", return_attention_mask=False).keys())
    for name, component in data_config.configs.items():
        base = component.cache_dir or os.path.join(data_config.cache_dir, name)
        for split in ("train", "validation"):
            split_dir = os.path.join(base, split)
            fs, path = fsspec.core.url_to_fs(split_dir)
            if not fs.exists(os.path.join(path, "shard_ledger.json")):
                if split == "train" and name in trained_components(data_config.train_weights):
                    raise FileNotFoundError(f"mixture component {name!r}: no finished cache at {split_dir}")
                continue
            arrays = [f for f in fs.ls(path, detail=True) if f["type"] == "directory"]
            if not arrays:
                raise FileNotFoundError(
                    f"cache {split_dir} has a ledger but no arrays in the store; it was written somewhere else "
                    "(or only half-copied): rebuild it with `marin materialize tokenized/... --rebuild`"
                )
            missing = [f for f in fields if not fs.isdir(os.path.join(path, f))]
            if missing:
                raise ValueError(
                    f"cache {split_dir} lacks fields {missing} that tokenizer {data_config.tokenizer!r} returns; "
                    "save the tokenizer with model_input_names=['input_ids', 'attention_mask']"
                )
            try:
                # Levanter's own loader, through tensorstore: what training will do next.
                len(TreeCache.load(split_dir, {f: np.zeros((0,), dtype=np.int32) for f in fields}).store)
            except Exception as exc:
                raise OSError(f"cannot read cache {split_dir} through tensorstore: "
                              f"{type(exc).__name__}: {exc}") from exc


UNFINISHED_CHECKPOINTS_DIR = "unfinished"


def set_aside_unfinished_checkpoints(checkpoint_dir: str) -> list[str]:
    """Move checkpoints whose ``metadata.json`` does not parse into ``<checkpoint_dir>/unfinished/``.

    Levanter opens ``metadata.json`` for writing and then dumps into it, so a process killed between the
    two leaves an empty file; its discovery then fails on ``json.load`` and the run could never resume.
    Moved one level down, discovery no longer sees them, the previous checkpoint is resumed, and the bytes
    are kept for inspection. Returns the moved paths.
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    if not fs.isdir(root):
        return []
    moved = []
    for path in sorted(fs.glob(f"{root.rstrip('/')}/step-*")):
        metadata = f"{path}/metadata.json"
        if not fs.exists(metadata):
            continue  # still being written, or never finished: discovery skips it already
        try:
            record = json.loads(fs.cat_file(metadata))
            if isinstance(record, dict) and "timestamp" in record and "step" in record:
                continue
        except ValueError:
            pass
        name = path.rstrip("/").rsplit("/", 1)[-1]
        target = f"{root.rstrip('/')}/{UNFINISHED_CHECKPOINTS_DIR}/{name}-{time.strftime('%Y%m%dT%H%M%S')}"
        fs.mv(path, target, recursive=True)
        moved.append(target)
    return moved


def _latest_checkpoint(checkpoint_dir: str) -> str | None:
    from levanter.checkpoint import discover_latest_checkpoint

    return discover_latest_checkpoint(checkpoint_dir)


def summarize(metrics_path: Path, attempt: int) -> dict[str, Any]:
    """Run-level figures from metrics.jsonl (all attempts for loss; this attempt for throughput)."""
    records = read_metrics(metrics_path)
    if not records:
        raise RuntimeError(f"training logged no steps to {metrics_path}")
    this_attempt = [r for r in records if r.get("attempt") == attempt]
    steady = this_attempt[_WARMUP_STEPS:] or this_attempt
    last_eval = next((r for r in reversed(records) if r.get("eval/loss") is not None), None)
    return {
        "final_step": records[-1]["step"] + 1,
        "train_loss_first": records[0]["loss"],
        "train_loss_last": records[-1]["loss"],
        "tokens_per_second": median(r.get("tokens_per_second") for r in steady),
        "mfu": median(r.get("mfu") for r in steady),
        "resumed_from_step": this_attempt[0]["step"] if this_attempt else None,
        # This attempt's first step: XLA's compilation of the train step, and the step itself.
        "first_step_seconds": this_attempt[0].get("step_seconds") if this_attempt else None,
        "eval_loss_last": last_eval["eval/loss"] if last_eval else None,
        "steps_logged": len(records),
    }


def _finished_summary(output_dir: Path, steps: int) -> dict[str, Any] | None:
    path = output_dir / SUMMARY_FILE
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    latest = summary.get("latest_checkpoint_path")
    if summary.get("final_step", 0) >= steps and latest and _exists(latest):
        return summary
    return None


class StoreMirror:
    """The run's record files (metrics, summary) kept in the store beside checkpoints that Levanter
    writes there directly, so that a run resumed on a fresh machine continues its attempt count and
    loss history. ``metrics.jsonl`` is copied as each checkpoint save begins (so the bucket's copy
    covers every step up to that checkpoint's) and when training ends."""

    FILES = (METRICS_FILE, SUMMARY_FILE)

    def __init__(self, local_dir: Path, store_dir: str):
        import fsspec

        self.local_dir, self.store_dir = local_dir, store_dir.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.store_dir)

    @classmethod
    def for_checkpoints(cls, checkpoint_base: str, output_dir: Path) -> StoreMirror | None:
        """A mirror when checkpoints go to an object store (their parent is the run's store directory)."""
        if "://" not in checkpoint_base or checkpoint_base.startswith("file://"):
            return None
        return cls(output_dir, os.path.dirname(checkpoint_base.rstrip("/")))

    def restore(self) -> list[str]:
        """Fetch record files this machine lacks (a wiped scratch); returns their names."""
        fetched = []
        for name in self.FILES:
            local, remote = self.local_dir / name, f"{self.root}/{name}"
            if not local.exists() and self.fs.exists(remote):
                self.fs.get_file(remote, str(local))
                fetched.append(name)
        return fetched

    def push_metrics(self, pending: dict[str, Any] | None) -> None:
        """metrics.jsonl plus ``pending``, the record of the step being checkpointed: Levanter saves it
        before its last values are logged, so the local file does not have it yet, and a resume from this
        copy starts after it. (The complete record replaces it at the next push: readers keep the last.)"""
        local = self.local_dir / METRICS_FILE
        text = local.read_text() if local.exists() else ""
        with self.fs.open(f"{self.root}/{METRICS_FILE}", "w") as fh:
            fh.write(text + (json.dumps(pending) + "\n" if pending else ""))

    def push(self, *names: str) -> None:
        for name in names:
            local = self.local_dir / name
            if local.exists():
                self.fs.put_file(str(local), f"{self.root}/{name}")


def next_attempt(metrics_path: Path) -> int:
    return max((r.get("attempt", 0) for r in read_metrics(metrics_path)), default=-1) + 1


def train(config_path: str, output_dir: Path, reporter: Reporter, *, report_every: int | None = None,
          init_sha256: str | None = None, fused_loss: bool = False) -> dict[str, Any]:
    """Run Levanter training for ``config_path``; returns the run summary (also written to train_summary.json).
    ``init_sha256``: the content hash the config's initial weights (``initialize_from_hf``) must have.
    ``fused_loss``: compute the training loss with the Pallas head-and-cross-entropy kernels
    (`marin_assets.training.fused_loss`) where they can run: one TPU device; elsewhere XLA's, logged."""
    from levanter.main import train_lm

    from marin_assets.tokenization.cache_format import name_tokenizer_as_ledgers_do
    from marin_assets.training import jax_compat
    from marin_assets.training.flat_dots import use_flat_dots
    from marin_assets.training.levanter_config import parse_train_config
    from marin_assets.training.rotary_matmul import use_rotary_matmul
    from marin_resources.storage.object_stores import install_tensorstore_paths

    install_tensorstore_paths()
    jax_compat.install()  # Levanter on the host's JAX (0.7.2 or a TPU image's 0.10)
    output_dir.mkdir(parents=True, exist_ok=True)
    config = parse_train_config(config_path)
    name_tokenizer_as_ledgers_do(config.data)  # the caches' ledgers name it so: no metadata mismatch
    group = ProcessGroup.from_env()
    if group is not None:
        join_process_group(group, float(os.environ.get(COORDINATOR_TIMEOUT_ENV, DEFAULT_COORDINATOR_TIMEOUT_S)))
    if group is not None or sole_process():
        # Joined above, or alone: Levanter must not start jax.distributed on its own. A multi-host TPU slice
        # without our launcher's group (several workers named, or none) is still Levanter's to detect and join.
        config = dataclasses.replace(config, trainer=dataclasses.replace(
            config.trainer, distributed=dataclasses.replace(config.trainer.distributed,
                                                            initialize_jax_distributed=False)))
    flat_dots = use_flat_dots()  # after jax.distributed: it asks JAX for its backend
    rotary_matmul = use_rotary_matmul()
    # Every process trains; process 0 alone keeps the run's records (metrics, summary, curve, mirror).
    leader = group is None or group.process_id == 0
    checkpoints = config.trainer.checkpointer.expanded_path(config.trainer.id)
    mirror = StoreMirror.for_checkpoints(checkpoints, output_dir) if leader else None
    if mirror is not None:
        restored = mirror.restore()
        if restored:
            reporter.log(f"restored {', '.join(restored)} from {mirror.store_dir}")
    if leader:
        for path in set_aside_unfinished_checkpoints(checkpoints):
            reporter.log(f"set aside a checkpoint whose metadata.json is incomplete (killed while saving): {path}")
    check_caches_readable(config.data)
    vocab_size = len(config.data.the_tokenizer)
    flops_per_token = training_flops_per_token(model_spec_from_levanter(config.model), vocab_size)

    metrics_path = output_dir / METRICS_FILE
    attempt = next_attempt(metrics_path)
    steps = config.trainer.num_train_steps
    finished = _finished_summary(output_dir, steps) if leader else None
    if _agreed(finished is not None):
        # Training completed before (e.g. the artifact commit was interrupted): Levanter refuses to run
        # zero steps, and there is nothing to redo.
        reporter.log(f"{config.trainer.id} already reached step {steps}; reporting the finished run")
        return finished or {}
    init_scratch = None
    if config.initialize_from_hf and _latest_checkpoint(checkpoints) is None:
        # Levanter reads them only for a run with no checkpoint yet: a resumed run has its own weights.
        init_scratch = tempfile.TemporaryDirectory(prefix="marin-init-")
        config = start_from_weights(config, init_sha256, init_scratch.name, reporter)
    sink = StepMetricsSink(
        metrics_path if leader else Path(os.devnull), reporter, flops_per_token, attempt,
        report_every or max(1, steps // 100), steps
    )
    sink_key = str(metrics_path)
    _SINKS[sink_key] = sink
    tracker_config = _metrics_tracker_config_class()(sink_key=sink_key)
    existing = config.trainer.tracker if isinstance(config.trainer.tracker, tuple) else (config.trainer.tracker,)
    config = dataclasses.replace(
        config, trainer=dataclasses.replace(config.trainer, tracker=(tracker_config, *existing))
    )

    reporter.log(f"training {config.trainer.id} for {steps} steps (attempt {attempt}) into {output_dir}")
    started = time.time()
    loss_kernel = "xla"
    if fused_loss:
        import jax

        from marin_assets.training import fused_loss as kernels

        if kernels.usable(jax.default_backend(), jax.device_count()):
            loss_kernel = "pallas_fused"
        else:
            reporter.log(f"fused loss: not on {jax.device_count()} {jax.default_backend()} device(s) (one TPU "
                         "only); the loss is XLA's")
    # train_lm.main constructs `Trainer` and its loss by module-global names; swap them in for this call only.
    original_trainer, original_loss = train_lm.Trainer, train_lm.compute_next_token_loss
    if loss_kernel == "pallas_fused":
        train_lm.compute_next_token_loss = kernels.levanter_next_token_loss(original_loss)
    sharding: dict[str, Any] = {}
    train_lm.Trainer = _final_checkpoint_trainer_class(
        before_save=None if mirror is None else lambda: mirror.push_metrics(sink.pending()),
        after_train=lambda model: sharding.update(largest_weight_sharding(model)))
    try:
        train_lm.main(config)
    except RuntimeError as exc:
        if str(exc) != LEVANTER_NAN_LOSS:
            raise
        raise TrainingDiverged(sink.divergence()) from None
    finally:
        train_lm.Trainer, train_lm.compute_next_token_loss = original_trainer, original_loss
        if init_scratch is not None:
            init_scratch.cleanup()
        sink.close()
        del _SINKS[sink_key]
    elapsed = time.time() - started
    if not leader:
        return {}

    summary = summarize(metrics_path, attempt)
    summary.update(
        {
            "run_id": config.trainer.id,
            "attempt": attempt,
            "num_train_steps": steps,
            "parameter_count": sink.summary.get("parameter_count"),
            "flops_per_token": flops_per_token,
            "device_kind": sink.summary.get("device_kind"),
            "device_count": sink.summary.get("device_count"),
            "process_count": sink.summary.get("process_count"),
            **mesh_axis_sizes(config.trainer),
            "sharded_weight": sharding or None,
            "flat_dots": flat_dots,
            "rotary_matmul": rotary_matmul,
            "loss_kernel": loss_kernel,
            "peak_device_memory_bytes": peak_device_memory(),
            "train_seconds": elapsed,
            "wandb_run_dir": sink.wandb_run_dir,
            "checkpoint_dir": checkpoints,
            "latest_checkpoint_path": _latest_checkpoint(checkpoints),
            "metrics_path": str(metrics_path),
            "loss_curve_png": plot_loss_curve(metrics_path, output_dir / LOSS_CURVE_FILE, title=config.trainer.id),
        }
    )
    if summary["final_step"] < steps:
        raise RuntimeError(f"training stopped at step {summary['final_step']} of {steps}; the data may be exhausted")
    with open(output_dir / SUMMARY_FILE, "w") as f:
        json.dump(summary, f, indent=2)
    if mirror is not None:
        mirror.push(METRICS_FILE, SUMMARY_FILE)
    return summary


def peak_device_memory() -> int | None:
    """The most memory the first device held at once in this process (TPU and GPU report it; CPU does not)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def start_from_weights(config, expected_sha256: str | None, scratch: str, reporter: Reporter):
    """``config`` with ``initialize_from_hf`` pointing at a local copy of the weights it names, checked
    against the run (`init_weights.check_weights`) and, with ``expected_sha256``, against the content
    hash the run's identity holds. Bad weights raise `InitWeightsError` before anything trains."""
    if config.initialize_from_hf is True:
        raise InitWeightsError("initialize_from_hf: true names no weights; give a directory, URL or ORG/NAME@REVISION")
    uri = uri_of_reference(str(config.initialize_from_hf))
    local = stage_weights(uri, expected_sha256, scratch)
    tokenizer = config.data.the_tokenizer
    check_weights(local, config.model.to_hf_config(len(tokenizer)).to_dict(), tokenizer)
    reporter.log(f"starting from the weights of {uri}"
                 + (f" (sha256 {expected_sha256[:12]})" if expected_sha256 else ""))
    return dataclasses.replace(config, initialize_from_hf=local)


def main(argv: list[str] | None = None) -> None:
    parser = process_parser(__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="Levanter TrainLmConfig YAML (from build_train_config)")
    parser.add_argument("--output-dir", help="run directory; defaults to the config file's directory")
    parser.add_argument("--report-every", type=int, help="send a Pipes progress message every N steps")
    parser.add_argument("--final-eval", action="store_true",
                        help=f"evaluate the final checkpoint into OUTPUT_DIR/{FINAL_EVAL_FILE}")
    parser.add_argument("--final-eval-examples", type=int,
                        help="with --final-eval: score this many sequences per set, evenly spaced (default: all)")
    parser.add_argument("--init-sha256", help="the content hash the initial weights (initialize_from_hf) must have")
    parser.add_argument("--fused-loss", action="store_true",
                        help="the training loss through the Pallas head-and-cross-entropy kernels (one TPU device)")
    args = parse_process_args(parser, argv)
    output_dir = Path(args.output_dir or os.path.dirname(os.path.abspath(args.config)))
    # W&B writes its run directory under WANDB_DIR; keep it with the run's other outputs.
    os.environ.setdefault("WANDB_DIR", str(output_dir))
    with exits_when_held("train_main"), \
            input_errors((InitWeightsError, TrainingDiverged), output_dir / INPUT_ERROR_FILE), \
            open_reporter() as reporter:
        try:
            summary = train(args.config, output_dir, reporter, report_every=args.report_every,
                            init_sha256=args.init_sha256, fused_loss=args.fused_loss)
        except CoordinatorUnreachable as exc:
            raise SystemExit(f"train_main: {exc}") from None
        if not summary:
            return  # not process 0 of a multi-process job: its records are process 0's
        if args.final_eval and summary.get("process_count", 1) > 1:
            reporter.log("final evaluation skipped: the run spans processes; eval/<run> evaluates in its own process")
        elif args.final_eval:
            write_final_eval(args.config, output_dir, reporter, sample_examples=args.final_eval_examples)
        reporter.materialization(summary, asset_key=args.asset_key)


def write_final_eval(config_path: str, output_dir: Path, reporter: Reporter, *,
                     sample_examples: int | None = None) -> None:
    """The final checkpoint's eval report, as the eval process would write it for the run's
    ``final_eval_examples`` (``sample_examples``; None scores every sequence).

    A failure here is logged and leaves no report: the trained checkpoint still commits, and
    eval/<run> then evaluates in its own process, where the same error fails that step.
    """
    from marin_assets.training.eval_main import evaluate_checkpoint, write_report

    path = output_dir / FINAL_EVAL_FILE
    if path.exists():
        return
    started = time.time()
    try:
        report = evaluate_checkpoint(config_path, sample_examples=sample_examples, log=reporter.log)
    except Exception as exc:  # noqa: BLE001 - reported, and redone by eval/<run>
        reporter.log(f"final evaluation failed ({type(exc).__name__}: {exc}); eval/<run> will evaluate in "
                     "its own process")
        return
    write_report(report, path)
    reporter.log(f"final evaluation in {time.time() - started:.1f}s: " + ", ".join(
        f"{k} = {v:.4f}" for k, v in report.items() if k.endswith(("/loss", "/bpb")) and v is not None))


if __name__ == "__main__":
    main()
    # Done: the exit handlers (W&B's, logging's) run and the output is flushed, but the interpreter's
    # teardown of JAX, Levanter and Ray (1.7 CPU-s of a training process) is skipped; a failure
    # above exits as usual. marin_resources/process_exit.py says why.
    from marin_resources.process_exit import exit_now

    exit_now(0)
