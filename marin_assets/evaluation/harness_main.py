"""Harness process: lm-eval tasks (through Levanter's eval harness) and held-out bits-per-byte for a checkpoint.

Usage: ``python -m marin_assets.evaluation.harness_main --config OUT/train_config.yaml
--harness OUT/harness_config.json --output OUT/harness_report.json [--checkpoint PATH]``

``harness_config.json`` is ``suites.render_harness_config``: task groups (one lm-eval run per
``limit``), whether lm-eval's bundled tasks are needed, the directory of offline task YAMLs, and the
held-out caches to evaluate for bits-per-byte (``{name: cache_root}``).

Bad input (an unknown task, a task whose data file is missing, a run without a usable tokenizer, no
checkpoint) is checked before the model is loaded; the process then writes one line to
``OUT/harness_error.txt`` and exits with status 2, and the asset reports that line.

The report holds, per task, ``<task>/acc``, ``<task>/acc_stderr``, ``<task>/acc_norm``,
``<task>/acc_norm_stderr`` and ``<task>/n`` (documents evaluated), and per held-out set
``eval/<set>/loss`` and ``eval/<set>/bpb`` (as ``eval_main`` defines them).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from marin_assets.evaluation.suites import lm_eval_version
from marin_assets.training.process import input_errors, parse_process_args, process_parser
from marin_assets.training.reporting import open_reporter
from marin_resources.progress import progress_line

ERROR_FILE = "harness_error.txt"
BOOTSTRAP_ITERS = 1000
"""lm-eval computes no stderr at 0 (Levanter's default); a mean (acc) gets the closed-form stderr at
any positive value, and only metrics without one (median, F1, BLEU) are bootstrapped this many times."""
TASK_METRICS = ("acc", "acc_norm")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class HarnessInputError(ValueError):
    """Input the harness cannot run on; its message is the one line the asset reports."""


def check_offline_tasks(task_dir: str | None, names: list[str]) -> None:
    """Each offline task has its YAML in ``task_dir`` and every data file that YAML reads."""
    from marin_assets.evaluation.next_line import TASK_FILE_SUFFIX, task_data_files

    for name in names:
        path = Path(task_dir or ".") / f"{name}{TASK_FILE_SUFFIX}"
        if task_dir is None or not path.is_file():
            raise HarnessInputError(f"offline task {name!r}: no task config at {path}")
        for data_file in task_data_files(path.read_text()):
            if not Path(data_file).is_file():
                raise HarnessInputError(f"offline task {name!r}: data file {data_file} is missing")


def check_tokenizer(tokenizer: str) -> None:
    """The run's tokenizer directory exists and holds a Hugging Face tokenizer."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(tokenizer)
    if not any(fs.exists(f"{path.rstrip('/')}/{name}") for name in TOKENIZER_FILES):
        raise HarnessInputError(f"the checkpoint's run config names tokenizer {tokenizer}, which holds no "
                                f"{' or '.join(TOKENIZER_FILES)}; the run cannot be evaluated without its tokenizer")


def task_manager(task_dir: str | None, include_bundled: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=task_dir, include_defaults=include_bundled)


def check_task_names(manager, task_spec: list[dict[str, Any]]) -> None:
    known = set(manager.all_tasks)
    unknown = sorted({t["task"] for t in task_spec} - known)
    if unknown:
        raise HarnessInputError(f"unknown lm-eval task(s) {unknown}: neither lm-eval {lm_eval_version()}'s "
                                "registry nor the suite's offline tasks define them")


def _leaf_tasks(tree: dict):
    for value in tree.values():
        if isinstance(value, dict):
            yield from _leaf_tasks(value)
        else:
            yield value


def tolerate_text_results() -> None:
    """Levanter averages every result field but ``alias`` and stderrs; lm-eval 0.4.13 also reports
    text fields (e.g. the task's name), on which numpy's mean fails. Average the numbers only."""
    import levanter.eval_harness as bridge

    average = bridge._compute_averages
    if getattr(average, "numbers_only", False):
        return

    def numbers_only(outputs):
        results = {task: {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                   for task, row in outputs["results"].items()}
        return average({**outputs, "results": results})

    numbers_only.numbers_only = True
    bridge._compute_averages = numbers_only


def harness_config_class():
    """Levanter's ``LmEvalHarnessConfig`` with a task manager that also reads local task YAMLs.

    Levanter's own ``to_task_dict`` builds lm-eval's default manager (bundled tasks only) and hands
    lm-eval each task as a dict, which lm-eval 0.4.13 builds as a new inline task instead of an
    override of the registered one. Here each task is loaded by name, then given its shot count
    (as lm-eval's ``simple_evaluate`` does) and, with an alias, renamed by Levanter's helper.
    """
    import dataclasses

    from levanter.eval_harness import LmEvalHarnessConfig
    from lm_eval.tasks import get_task_dict

    @dataclasses.dataclass(frozen=True)
    class LocalTasksHarnessConfig(LmEvalHarnessConfig):
        task_dir: str | None = None
        include_bundled: bool = True

        def to_task_dict(self) -> dict:
            manager = task_manager(self.task_dir, self.include_bundled)
            tasks: dict = {}
            for spec in self.to_task_spec():
                name = spec["task"]
                loaded = get_task_dict([name], manager)
                for task in _leaf_tasks(loaded):
                    task.set_config(key="num_fewshot", value=spec.get("num_fewshot", 0))
                alias = spec.get("task_alias")
                if alias and alias != name:
                    loaded = self._rename_tasks_for_eval_harness(loaded, name, alias)
                for key, task in loaded.items():
                    if key in tasks:
                        raise ValueError(f"task {key} appears twice")
                    tasks[key] = task
            return tasks

    return LocalTasksHarnessConfig


def task_metrics(results: dict[str, Any], n_samples: dict[str, Any], name: str) -> dict[str, float]:
    """``<name>/acc``, ``<name>/acc_stderr`` ... from lm-eval's results (keys like ``acc,none``)."""
    row = results.get(name)
    if row is None:
        raise RuntimeError(f"lm-eval returned no results for {name!r} (got {sorted(results)})")
    out: dict[str, float] = {}
    for metric in TASK_METRICS:
        for key in (metric, f"{metric}_stderr"):
            value = row.get(f"{key},none")
            if isinstance(value, (int, float)):
                out[f"{name}/{key}"] = float(value)
    counts = n_samples.get(name) or {}
    if "effective" in counts:
        out[f"{name}/n"] = int(counts["effective"])
    return out


def with_heldout_sets(config_path: str, caches: dict[str, str], out_dir: str) -> str:
    """A copy of the run's config whose mixture also holds ``caches`` as validation-only components."""
    import yaml

    with open(config_path) as fh:
        config = yaml.safe_load(fh)
    data = config["data"]
    for name, cache_root in caches.items():
        existing = data["configs"].get(name)
        if existing is not None and existing.get("cache_dir") != cache_root:
            raise HarnessInputError(f"held-out set {name!r} clashes with the run's mixture component of that name")
        data["configs"][name] = {"cache_dir": cache_root, "train_urls": [], "validation_urls": []}
        if isinstance(data["train_weights"], dict):  # a schedule ([[step, weights], ...]) gives it none either
            data["train_weights"].setdefault(name, 0.0)
    path = os.path.join(out_dir, "heldout_config.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(config, fh, sort_keys=False)
    return path


def run_harness(config_path: str, harness: dict[str, Any], *, checkpoint_path: str | None = None,
                log=print) -> dict[str, Any]:
    """Check the inputs, then run every task group and held-out set; returns the report."""
    task_dir = harness.get("task_dir")
    check_offline_tasks(task_dir, sorted({v["task"] for v in harness.get("offline_tasks", {}).values()}))
    import haliax as hax
    from haliax import Axis
    from haliax.partitioning import round_axis_for_partitioning

    from marin_assets.training import jax_compat
    from marin_assets.training.eval_main import (
        eval_batch_axis,
        evaluate_checkpoint,
        load_trained_model,
        resolve_checkpoint,
    )
    from marin_assets.training.levanter_config import parse_train_config
    from marin_resources.storage.object_stores import install_tensorstore_paths

    install_tensorstore_paths()
    jax_compat.install()  # Levanter on the host's JAX (0.7.2 or a TPU image's 0.10)
    config = parse_train_config(config_path)
    check_tokenizer(config.data.tokenizer)
    try:
        checkpoint = resolve_checkpoint(config, checkpoint_path)
    except FileNotFoundError as exc:
        raise HarnessInputError(str(exc)) from None
    groups = harness.get("groups", [])
    report: dict[str, Any] = {"checkpoint_path": checkpoint, "suite": harness.get("suite")}
    if groups:
        from levanter.eval_harness import run_lm_eval_harness
        from levanter.utils.tree_utils import inference_mode

        started = time.monotonic()
        manager = task_manager(task_dir, harness.get("include_bundled_tasks", False))
        check_task_names(manager, [t for g in groups for t in g["task_spec"]])
        report["lm_eval_version"] = lm_eval_version()
        trainer = config.trainer
        tokenizer = config.data.the_tokenizer
        config_class = harness_config_class()
        tolerate_text_results()
        with trainer.use_device_mesh(), hax.axis_mapping(trainer.parameter_axis_mapping):
            Vocab = round_axis_for_partitioning(Axis("vocab", len(tokenizer)), trainer.compute_axis_mapping)
            model = inference_mode(load_trained_model(config, checkpoint, Vocab), True)
            from levanter.eval_harness import TaskConfig

            for group in groups:
                names = ", ".join(t.get("task_alias", t["task"]) for t in group["task_spec"])
                limit = f" ({group['limit']} items each)" if group.get("limit") else ""
                log(progress_line(f"lm-eval: {names}{limit}"))
                harness_config = config_class(task_spec=[TaskConfig(**t) for t in group["task_spec"]],
                                              max_examples=group.get("limit"), bootstrap_iters=BOOTSTRAP_ITERS,
                                              task_dir=task_dir,
                                              include_bundled=harness.get("include_bundled_tasks", False))
                outputs = run_lm_eval_harness(harness_config, model, tokenizer, eval_batch_axis(trainer),
                                              axis_resources=trainer.compute_axis_mapping, mp=trainer.mp)
                for task in group["task_spec"]:
                    name = task.get("task_alias", task["task"])
                    metrics = task_metrics(outputs["results"], outputs.get("n-samples", {}), name)
                    log(progress_line(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in metrics.items())))
                    report.update(metrics)
        for name, task in harness.get("offline_tasks", {}).items():
            report[f"{name}/chance"] = 1.0 / task["choices"]
        report["harness_seconds"] = round(time.monotonic() - started, 2)
    heldout = harness.get("bpb") or {}
    if heldout:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="marin-heldout-") as scratch:
            heldout_config = with_heldout_sets(config_path, heldout, scratch)
            bpb = evaluate_checkpoint(heldout_config, checkpoint_path=checkpoint, eval_sets=sorted(heldout),
                                      num_samples=0, log=log)
        report.update({k: v for k, v in bpb.items() if k.startswith("eval/")})
        report["bpb_seconds"] = round(time.monotonic() - started, 2)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = process_parser(__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the run's Levanter train config YAML")
    parser.add_argument("--harness", required=True, help="the rendered suite (harness_config.json)")
    parser.add_argument("--checkpoint", help="checkpoint dir (or a parent to search); default: the run's latest")
    parser.add_argument("--output", required=True, help="where to write the JSON report")
    args = parse_process_args(parser, argv)
    out_dir = Path(args.output).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(args.harness) as fh:
        harness = json.load(fh)
    # lm-eval reads local task data through HF datasets' packaged json loader, which caches what it
    # parses: in scratch, not in the artifact or the home directory.
    with input_errors(HarnessInputError, out_dir / ERROR_FILE), open_reporter() as reporter, \
            tempfile.TemporaryDirectory(prefix="marin-hf-datasets-") as hf_cache:
        os.environ.setdefault("HF_DATASETS_CACHE", hf_cache)
        report = run_harness(args.config, harness, checkpoint_path=args.checkpoint, log=reporter.log)
        with open(args.output, "w") as fh:
            json.dump(report, fh, indent=2)
        reporter.materialization({**report, "harness_report_path": os.path.abspath(args.output)},
                                 asset_key=args.asset_key)

if __name__ == "__main__":
    main()
    # Without the interpreter's teardown of JAX and Levanter, as train_main ends (process_exit.py).
    from marin_resources.process_exit import exit_now

    exit_now(0)
