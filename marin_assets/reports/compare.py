"""Runs side by side: their committed training and evaluation results as one table, and their loss
curves on one plot (`marin compare`, the `reports/run_comparison` asset).

Everything is read from the store, never recomputed: a run's checkpoint manifest (parameters,
steps, final train loss, the spec it was trained with) and its ``metrics.jsonl``, and the manifests
of its evaluations (``eval``, ``harness_eval``, ``cross_eval/<source>``, or a sweep's own). An
evaluation counts only if it read the checkpoint shown: one of an earlier checkpoint of the run is
left out with a note, so no row mixes two trainings.

No Dagster here: callers say where each run's artifacts are (`RunKeys`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marin_assets.training.metrics import eval_sets, parse_metrics, pyplot
from marin_assets.training.train_main import METRICS_FILE
from marin_resources.storage.store import ArtifactStore, Manifest

MISSING = "-"


class CompareError(ValueError):
    """A run that cannot be compared (unknown, or never trained); the message is one line."""


@dataclass(frozen=True)
class RunKeys:
    """Where one run's artifacts are stored: ``(asset key, code version)`` of its checkpoint and of
    every evaluation that may hold results for it (all partitioned by the run's name)."""

    checkpoint: tuple[str, str]
    evaluations: tuple[tuple[str, str], ...]
    trained_by: str
    """How to train it, for the refusal of a run with no checkpoint (`marin materialize ...`)."""


@dataclass
class RunResults:
    """One run's committed results, flattened: ``values`` by metric name (manifest metric names,
    plus ``mixture``, ``tokenizer``, ``tokens_trained``), and its per-step training records."""

    name: str
    values: dict[str, Any]
    curve: list[dict[str, Any]]
    tokens_per_step: int | None
    notes: list[str] = field(default_factory=list)
    config: Mapping[str, Any] = field(default_factory=dict)
    """The run config its checkpoint was trained from (the checkpoint's identity)."""


def load_run(store: ArtifactStore, name: str, keys: RunKeys) -> RunResults:
    """A trained run's results from its committed manifests; `CompareError` when it has no checkpoint."""
    key, version = keys.checkpoint
    checkpoint = store.find(key, version, name)
    if checkpoint is None:
        raise CompareError(f"run {name!r} has no committed checkpoint in {store.prefix}: train it first "
                           f"({keys.trained_by})")
    values = checkpoint_values(checkpoint)
    notes = []
    for eval_key, eval_version in keys.evaluations:
        manifest = store.find(eval_key, eval_version, name)
        if manifest is None:
            continue
        if not evaluated(checkpoint, manifest):
            notes.append(f"{eval_key}[{name}] evaluated an earlier checkpoint of the run; left out "
                         f"(marin materialize {eval_key} --partition {name})")
            continue
        for metric, value in manifest.metrics.items():
            values.setdefault(metric, value)  # the first evaluation listed wins a metric both report
    try:
        with store.open(f"{checkpoint.uri}/{METRICS_FILE}") as fh:
            curve = parse_metrics(fh.read().decode("utf-8").splitlines())
    except FileNotFoundError:
        curve = []
        notes.append(f"{key}[{name}] holds no {METRICS_FILE}: no loss curve")
    config = checkpoint.config if isinstance(checkpoint.config, Mapping) else {}
    return RunResults(name, values, curve, tokens_per_step(config), notes, config)


def evaluated(checkpoint: Manifest, evaluation: Manifest) -> bool:
    """Whether ``evaluation`` read this version of ``checkpoint`` (its upstream records it)."""
    return any(u.asset_key == checkpoint.asset_key and u.data_version == checkpoint.data_version
               for u in evaluation.upstream)


def tokens_per_step(config: Any) -> int | None:
    """Tokens in one optimizer step of a run's identity config (batch x sequence length)."""
    try:
        return int(config["train_batch_size"]) * int(config["model"]["seq_len"])
    except (KeyError, TypeError, ValueError):
        return None


def checkpoint_values(checkpoint: Manifest) -> dict[str, Any]:
    config = checkpoint.config if isinstance(checkpoint.config, Mapping) else {}
    values: dict[str, Any] = {"mixture": config.get("mixture"), "tokenizer": config.get("tokenizer"),
                              "init_from": init_from_text(config.get("init_from")), **checkpoint.metrics}
    step_tokens = tokens_per_step(config)
    if step_tokens is not None and checkpoint.metrics.get("final_step") is not None:
        values["tokens_trained"] = int(checkpoint.metrics["final_step"]) * step_tokens
    return values


def init_from_text(init_from: Any) -> str | None:
    """Where a run's weights started (its identity's ``init_from``): the run or path, and the short
    content hash of the weights it resolved to; None for a run from scratch."""
    if not isinstance(init_from, Mapping):
        return None
    origin = f"run {init_from['run']}" if init_from.get("run") else str(init_from.get("path"))
    return f"{origin} (sha256 {init_from['sha256'][:12]})" if init_from.get("sha256") else origin


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A run config's leaves by dotted path (``optimizer.learning_rate``); a list is one leaf."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat |= flat_config(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


CONFIG_SHOWN = ("name", "mixture", "tokenizer", "init_from")
"""Run config fields never shown as a difference: the run's own name, and those with rows of their own."""


def config_differences(configs: Sequence[Mapping[str, Any]]) -> list[tuple[str, tuple[Any, ...]]]:
    """The run config fields (dotted paths) on which the runs differ, in first-seen order, with each
    run's value (None: the run's config has no such field). Any field a run file may hold counts,
    also one this table has no row for (a mixture schedule, a cooldown), so a comparison always says
    how its runs were set up differently."""
    flats = [flat_config(c) for c in configs]
    paths = dict.fromkeys(p for f in flats for p in f if p.split(".")[0] not in CONFIG_SHOWN)
    rows = []
    for path in paths:
        values = tuple(f.get(path) for f in flats)
        if any(v != values[0] for v in values):
            rows.append((path, values))
    return rows


# ---- the table ---------------------------------------------------------------------------------

TRAINING_ROWS = (
    ("mixture", "mixture"),
    ("tokenizer", "tokenizer"),
    ("init from", "init_from"),
    ("parameters", "parameter_count"),
    ("steps", "final_step"),
    ("tokens trained", "tokens_trained"),
    ("final train loss", "train_loss_last"),
    ("tokens/s", "tokens_per_second"),
    ("train seconds", "train_seconds"),
)


@dataclass(frozen=True)
class Comparison:
    """The table: one column per run, one row per metric any of them has (``None``: this run has none)."""

    runs: tuple[str, ...]
    rows: tuple[tuple[str, tuple[Any, ...]], ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"runs": list(self.runs), "rows": [{"metric": label, "values": dict(zip(self.runs, values))}
                                                  for label, values in self.rows],
                "notes": list(self.notes)}


def harness_tasks(values: Mapping[str, Any]) -> list[str]:
    return sorted({k.rsplit("/", 1)[0] for k in values if k.endswith("/acc") and not k.startswith("eval/")})


def margin(values: Mapping[str, Any], task: str) -> float | None:
    """``acc - 2 x stderr - chance`` (the `beats_chance` margin), where the task records its chance."""
    acc, err, chance = (values.get(f"{task}/{m}") for m in ("acc", "acc_stderr", "chance"))
    return None if acc is None or err is None or chance is None else float(acc - 2 * err - chance)


def accuracy(values: Mapping[str, Any], task: str) -> str | None:
    acc, err = values.get(f"{task}/acc"), values.get(f"{task}/acc_stderr")
    return None if acc is None else f"{acc:.4f} ± {err:.4f}" if err is not None else f"{acc:.4f}"


def compare(results: Sequence[RunResults]) -> Comparison:
    """The table of ``results``: mixture, tokenizer, initial weights and every other run config
    field on which the runs differ (`config_differences`), the training results, then loss and
    bits-per-byte of every eval set, then every harness task's accuracy and margin over chance. Rows
    no run has are left out."""
    rows: list[tuple[str, tuple[Any, ...]]] = []

    def add(label: str, cell) -> None:
        cells = tuple(cell(r.values) for r in results)
        if any(c is not None for c in cells):
            rows.append((label, cells))

    for label, key in TRAINING_ROWS:
        add(label, lambda v, k=key: v.get(k))
        if key == "init_from":  # the set-up, before the results
            rows.extend(config_differences([r.config for r in results]))
    every = {k: None for r in results for k in r.values}
    for name in eval_sets(every):
        for metric in ("loss", "bpb"):
            add(f"eval {name} {metric}", lambda v, k=f"eval/{name}/{metric}": v.get(k))
    for task in harness_tasks(every):
        add(f"{task} acc", lambda v, t=task: accuracy(v, t))
        add(f"{task} margin", lambda v, t=task: margin(v, t))
    return Comparison(tuple(r.name for r in results), tuple(rows), tuple(n for r in results for n in r.notes))


def is_real(value: Any) -> bool:
    return isinstance(value, float) and not isinstance(value, bool)


def number_format(values: Sequence[Any]) -> str:
    """The format of a row's non-integer numbers, set by the largest of them: from 1,000 up whole,
    from 100 up one decimal, below that 4 (losses, bits-per-byte), and where even the largest is
    under 0.001 (an optimizer's epsilon) 3 significant digits in scientific notation."""
    size = max((abs(v) for v in values if is_real(v) and math.isfinite(v)), default=0.0)
    return ",.0f" if size >= 1000 else ",.1f" if size >= 100 else ".4f" if size == 0 or size >= 1e-3 else ".2e"


def cell_text(value: Any, spec: str | None = None) -> str:
    """A table cell: counts with thousands separators, other numbers in the format ``spec`` (default:
    by their own size, `number_format`), a list (a config field's) as compact JSON, anything else as
    text."""
    if value is None:
        return MISSING
    if isinstance(value, (list, tuple)):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return format(value, number_format([value]) if spec is None else spec)


def row_cells(values: Sequence[Any]) -> list[str]:
    """A row's cells, its numbers in one format, so that a row reads down one scale (1,090 and 95,
    not 1,090 and 94.5979)."""
    spec = number_format(values)
    return [cell_text(v, spec) for v in values]


def text_table(comparison: Comparison) -> str:
    """The table for a terminal: aligned columns, metric names left, values right."""
    header = ("metric", *comparison.runs)
    body = [(label, *row_cells(values)) for label, values in comparison.rows]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))]).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in body)])


def markdown_table(comparison: Comparison) -> str:
    escape = lambda text: text.replace("|", "\\|")  # noqa: E731
    lines = ["| metric | " + " | ".join(escape(r) for r in comparison.runs) + " |",
             "|---|" + "---:|" * len(comparison.runs)]
    lines += [f"| {escape(label)} | " + " | ".join(escape(c) for c in row_cells(values)) + " |"
              for label, values in comparison.rows]
    return "\n".join(lines)


# ---- the plot ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Curve:
    """One run's points on the plot: train loss at every step, eval loss where it was measured."""

    run: str
    x: list[float]
    loss: list[float]
    eval_x: list[float]
    eval_loss: list[float]


def loss_curves(results: Sequence[RunResults]) -> tuple[str, list[Curve]]:
    """The x-axis and every run's curve: against tokens trained when every run's step size is known
    (runs of different batch sizes then line up), else against step. ValueError when no run has one."""
    drawn = [r for r in results if r.curve]
    if not drawn:
        raise ValueError(f"no loss curve to draw: none of {', '.join(r.name for r in results)} has {METRICS_FILE}")
    by_tokens = all(r.tokens_per_step for r in drawn)

    def x(run: RunResults, record: Mapping[str, Any]) -> float:
        return (record["step"] + 1) * run.tokens_per_step if by_tokens else record["step"]

    curves = []
    for run in drawn:
        evals = [r for r in run.curve if r.get("eval/loss") is not None]
        curves.append(Curve(run.name, [x(run, r) for r in run.curve], [r["loss"] for r in run.curve],
                            [x(run, r) for r in evals], [r["eval/loss"] for r in evals]))
    return ("tokens trained" if by_tokens else "step"), curves


def plot_loss_curves(results: Sequence[RunResults], png_path: str | Path) -> str:
    """Every run's train loss (a line) and in-training eval loss (points on a dashed line), one colour
    per run, on one plot (`loss_curves`); returns the PNG path."""
    x_label, curves = loss_curves(results)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for curve in curves:
        (line,) = ax.plot(curve.x, curve.loss, linewidth=1.2, label=f"{curve.run} train")
        if curve.eval_x:
            ax.plot(curve.eval_x, curve.eval_loss, "o--", color=line.get_color(), label=f"{curve.run} eval")
    ax.set_xlabel(x_label)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(" vs ".join(r.name for r in results))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return str(png_path)
