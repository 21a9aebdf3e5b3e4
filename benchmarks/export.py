"""Export time and size of a trained run as a Hugging Face directory, for Marin's llama_150m shape
next to the demo's nano model, on CPU.

For each size, built here from nothing but on-machine text and the pipeline's own code:
  1. a tokenizer with the size's vocabulary: the pipeline's byte-level BPE (``train_bpe_tokenizer``
     with the registry's ``shakespeare`` settings: BOS/EOS/pad, BOS on encode), trained on stdlib
     docstrings plus generated words. Docstrings alone support about 11,000 merges; the words
     (letters drawn by a seeded RNG) give the rest real merges, so a 128,256-entry tokenizer is a
     BPE model of that size (as Llama 3's is), not a small one padded with unused entries;
  2. a token cache of the docstrings, by the pipeline's cache builder
     (``build_levanter_cache_from_documents``);
  3. a short training run through ``train_main`` (the command the ``checkpoint`` asset launches);
  4. ``export_main`` on its final checkpoint (the command ``hf_model`` launches), timed from process
     start to exit, its peak RSS read from the kernel (``wait4``), and its report: parameters, the
     weight files and their bytes, the Flax check's largest logit difference and greedy match.

Sizes:
  nano        the demo's model (runs.yaml ``nano-shakespeare``), its tokenizer's vocabulary (4,096)
  llama_150m  benchmarks/gpu_train.py's llama_150m shape with Marin's Llama 3 vocabulary, 128,256
              entries (untied: most of its 154M parameters are the two embedding matrices)

Usage: python benchmarks/export.py [--sizes nano,llama_150m] [--steps 2] [--batch-size 2]
                                   [--max-shard-mb N] [--workdir DIR]
Prints the sizes side by side; the last line of output is one JSON object.
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
import random
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_train import SIZES as TRAIN_SIZES  # noqa: E402
from benchmarks.train import load_fixtures  # noqa: E402
from marin_assets.export.assets import DEFAULT_MAX_SHARD_MB  # noqa: E402
from marin_assets.tokenization.cache import build_levanter_cache_from_documents  # noqa: E402
from marin_assets.tokenization.cache_config import CacheConfig  # noqa: E402
from marin_assets.tokenization.registry import load_registry  # noqa: E402
from marin_assets.tokenization.tokenizer import TokenizerConfig, train_bpe_tokenizer  # noqa: E402
from marin_assets.training.commands import export_command, train_command  # noqa: E402
from marin_assets.training.export_main import EXPORT_REPORT_FILE  # noqa: E402
from marin_assets.training.levanter_config import build_train_config, write_train_config  # noqa: E402
from marin_assets.training.spec import ModelSpec, RunSpec, load_run_registry  # noqa: E402
from marin_assets.training.train_main import SUMMARY_FILE  # noqa: E402
from marin_resources.launchers import ProcessCommand, build_command_and_env  # noqa: E402

DEMO_RUN = "nano-shakespeare"
# A quarter of the docstrings held out: the export's check reads 4 validation sequences of up to
# 1,024 tokens, and the docstrings are only about 0.3 MB of text.
VALIDATION_FRACTION = 0.25
GENERATED_WORDS = 60_000
GENERATED_DOCUMENTS = 400
WORDS_PER_DOCUMENT = 1_000


@dataclasses.dataclass(frozen=True)
class Size:
    model: ModelSpec
    vocab_size: int


def demo_settings() -> tuple[RunSpec, TokenizerConfig]:
    """The demo's run spec and its tokenizer's settings: every size trains and tokenizes as the demo does."""
    demo = load_run_registry()[DEMO_RUN]
    return demo, load_registry().tokenizers[demo.tokenizer].config


def sizes(demo: RunSpec, demo_tokenizer: TokenizerConfig) -> dict[str, Size]:
    return {
        "nano": Size(demo.model, demo_tokenizer.vocab_size),
        "llama_150m": Size(TRAIN_SIZES["llama_150m"].model, TRAIN_SIZES["llama_150m"].vocab_size),
    }


def generated_documents(seed: int = 0) -> list[str]:
    """Text of made-up lowercase words, each used many times, so BPE has merges to learn up to
    a Llama-3-sized vocabulary. Deterministic for a seed."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = sorted({"".join(rng.choice(letters) for _ in range(rng.randint(4, 11))) for _ in range(GENERATED_WORDS)})
    return [" ".join(rng.choice(words) for _ in range(WORDS_PER_DOCUMENT)) for _ in range(GENERATED_DOCUMENTS)]


def build_tokenizer(docs: list[str], config: TokenizerConfig, vocab_size: int, out: Path) -> tuple[str, float]:
    """(tokenizer_dir, seconds): the pipeline's BPE tokenizer with exactly ``vocab_size`` entries."""
    config = dataclasses.replace(config, vocab_size=vocab_size)
    started = time.time()
    artifact = train_bpe_tokenizer(docs + generated_documents(), config, str(out))
    if artifact.vocab_size != vocab_size:
        raise SystemExit(f"the tokenizer at {out} has {artifact.vocab_size:,} entries, not {vocab_size:,}: "
                         "the training text supports too few merges (raise GENERATED_WORDS)")
    return artifact.path, time.time() - started


def run_process(process: ProcessCommand, work: Path) -> dict:
    """Run a pipeline process on CPU as the launcher would (log: ``work/{kind}_output.log``); its
    wall and CPU seconds, peak RSS, and the machine's 1-minute load average before and after."""
    launch = build_command_and_env(process, accelerator="cpu")
    log_path = work / f"{process.kind}_output.log"
    load_before = os.getloadavg()[0]
    started = time.time()
    with open(log_path, "w") as log:
        child = subprocess.Popen(launch.command, env={**os.environ, **launch.env}, stdout=log,
                                 stderr=subprocess.STDOUT, cwd=work)
        # wait4 reports this child's own resource use (getrusage(RUSAGE_CHILDREN) would mix in the others').
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.time() - started
    code = child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if code != 0:
        raise SystemExit(f"{process.kind} failed (exit {code}); last lines of {log_path}:\n"
                         + "\n".join(log_path.read_text().splitlines()[-40:]))
    return {"wall_seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "load_average": [load_before, os.getloadavg()[0]]}


def measure(name: str, size: Size, docs: list[str], *, demo: RunSpec, demo_tokenizer: TokenizerConfig, steps: int,
            batch_size: int, max_shard_mb: int, fixtures, work: Path) -> dict:
    work.mkdir(parents=True)
    tokenizer_dir, tokenizer_seconds = build_tokenizer(docs, demo_tokenizer, size.vocab_size, work / "tokenizer")
    cache_root = str(work / "cache")
    stats = build_levanter_cache_from_documents(((f"doc{i}", text) for i, text in enumerate(docs)), tokenizer_dir,
                                                cache_root, CacheConfig(validation_fraction=VALIDATION_FRACTION))

    spec: RunSpec = dataclasses.replace(
        demo, name=f"export-bench-{name}", model=size.model, train_batch_size=batch_size, num_train_steps=steps,
        steps_per_eval=10 * steps, max_eval_batches=1, checkpoint_every=10 * steps, watch_every=0)
    run_dir = work / "run"
    mixture = fixtures.single_cache_mixture(spec.mixture, cache_root, tokenizer_dir)
    config_path = write_train_config(build_train_config(spec, mixture, tokenizer_dir, str(run_dir)),
                                     run_dir / "train_config.yaml")
    train = run_process(train_command(config_path, str(run_dir)), work)
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())

    out = work / "hf_model"
    export = run_process(export_command(config_path, str(out), max_shard_bytes=max_shard_mb * 1024**2), work)
    report = json.loads((out / EXPORT_REPORT_FILE).read_text())
    expected = size.model.parameter_count(size.vocab_size)
    if report["parameters"] != expected:
        raise SystemExit(f"{name}: the export holds {report['parameters']:,} parameters; the shape has {expected:,}")
    return {
        "size": name,
        "checkpoint": report["checkpoint_path"],
        "model": dataclasses.asdict(size.model),
        "vocab_size": report["vocab_size"],
        "parameters": report["parameters"],
        "dtype": report["dtype"],
        "weight_files": {file: (out / file).stat().st_size for file in report["weight_files"]},
        "weight_bytes": sum((out / file).stat().st_size for file in report["weight_files"]
                            if file.endswith(".safetensors")),  # not the shards' index
        "export_dir_bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file()),
        "tokenizer_json_bytes": (out / "tokenizer.json").stat().st_size,
        "export_wall_seconds": export["wall_seconds"],
        "export_cpu_seconds": export["cpu_seconds"],
        "export_peak_rss_bytes": export["peak_rss_bytes"],
        "export_load_average": export["load_average"],
        "client_check": report["client_check"],
        "check_sequences": report.get("check_sequences"),
        "max_abs_logit_difference": report.get("max_abs_logit_difference"),
        "greedy_matches": report.get("greedy_matches"),
        "train_steps": summary["final_step"],
        "train_batch_size": batch_size,
        "train_wall_seconds": train["wall_seconds"],
        "train_peak_rss_bytes": train["peak_rss_bytes"],
        "tokenizer_seconds": tokenizer_seconds,
        "cache_tokens": {"train": stats.train.tokens, "validation": stats.validation.tokens},
        "workdir": str(work),
    }


ROWS = (
    ("parameters", lambda r: f"{r['parameters']:,}"),
    ("vocabulary", lambda r: f"{r['vocab_size']:,}"),
    ("safetensors files", lambda r: f"{sum(f.endswith('.safetensors') for f in r['weight_files'])} ({r['dtype']})"),
    ("weight bytes", lambda r: f"{r['weight_bytes'] / 1e6:,.1f} MB"),
    ("export dir bytes", lambda r: f"{r['export_dir_bytes'] / 1e6:,.1f} MB"),
    ("tokenizer.json", lambda r: f"{r['tokenizer_json_bytes'] / 1e6:,.2f} MB"),
    ("export wall", lambda r: f"{r['export_wall_seconds']:.1f} s"),
    ("export CPU", lambda r: f"{r['export_cpu_seconds']:.1f} s"),
    ("export peak RSS", lambda r: f"{r['export_peak_rss_bytes'] / 2**30:.2f} GiB"),
    ("load before/after", lambda r: "{:.1f} / {:.1f}".format(*r["export_load_average"])),
    ("max logit diff", lambda r: "n/a" if r["max_abs_logit_difference"] is None
     else f"{r['max_abs_logit_difference']:.2e} ({r['check_sequences']} seqs)"),
    ("greedy matches", lambda r: str(r["greedy_matches"]) if r["greedy_matches"] is not None else r["client_check"]),
    ("train", lambda r: f"{r['train_steps']} steps x {r['train_batch_size']}, {r['train_wall_seconds']:.0f} s"),
    ("train peak RSS", lambda r: f"{r['train_peak_rss_bytes'] / 2**30:.2f} GiB"),
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    demo, demo_tokenizer = demo_settings()
    known = sizes(demo, demo_tokenizer)
    parser.add_argument("--sizes", default="nano,llama_150m",
                        help=f"comma-separated, from {', '.join(known)} (default: both, side by side)")
    parser.add_argument("--steps", type=int, default=2, help="training steps before the export")
    parser.add_argument("--batch-size", type=int, default=2, help="training sequences per step")
    parser.add_argument("--max-shard-mb", type=int, default=DEFAULT_MAX_SHARD_MB,
                        help="shard the weights past this many MiB (hf_model's max_shard_mb)")
    parser.add_argument("--workdir")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in known]
    if unknown or not chosen:
        parser.error(f"--sizes: unknown {unknown or chosen}; choose from {', '.join(known)}")
    if args.steps < 1 or args.batch_size < 1 or args.max_shard_mb < 1:
        parser.error("--steps, --batch-size and --max-shard-mb must be positive")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-export-"))

    fixtures = load_fixtures()
    docs = fixtures.stdlib_docstrings()
    results = [measure(name, known[name], docs, demo=demo, demo_tokenizer=demo_tokenizer, steps=args.steps,
                       batch_size=args.batch_size, max_shard_mb=args.max_shard_mb, fixtures=fixtures,
                       work=work / name) for name in chosen]

    print(f"export_main on CPU, {os.cpu_count()} cores (load: the 1-minute average before and after the export)")
    print(f"{'':18}" + "".join(f"{r['size']:>26}" for r in results))
    for label, cell in ROWS:
        print(f"{label:18}" + "".join(f"{cell(r):>26}" for r in results))
    result = {"benchmark": "export", "cpu_count": os.cpu_count(), "max_shard_mb": args.max_shard_mb, "results": results}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
