"""A named run (the demo's ``nano-shakespeare`` by default) on a TPU host: the project's training,
evaluation and export processes, as the checkpoint, evaluation and hf_model assets launch them, on the
run's own token caches, and its loss curve beside the committed CPU run's.

A TPU host here has no Dagster and no network (docs/tpu-host.md): the asset graph cannot run there, so
this does what the assets' steps do around the processes, without Dagster, from a copy of the store's
part the run reads. In a deployment the assets launch the same commands in a TPU pod (docs/training.md).

  where the store is (after `marin materialize checkpoint --partition nano-shakespeare`):
      python deploy/tpu_host/named_run.py bundle --store PREFIX --out BUNDLE [--run RUN]
  on the TPU host (after deploy/tpu_host/install.sh):
      python3 deploy/tpu_host/named_run.py run BUNDLE --out OUT [--tpu-type v5litepod-1]

``bundle`` copies the run's mixture, token caches and tokenizer (their manifests too, so the copy is a
store of its own) and the CPU run's metrics. ``run`` renders the run's Levanter config for one TPU chip
(the run's identity is unchanged: its fingerprint must equal the CPU run's, or it refuses), plans its
memory before the chip is opened, then trains with the final evaluation, evaluates again in the eval
process, exports the Hugging Face model, and compares the two loss curves. The last line is one JSON
object; OUT/named_run.json holds it.
"""

from __future__ import annotations

import sys

if sys.path and sys.path[0].rstrip("/").endswith("tpu_host"):
    sys.path.pop(0)

import argparse
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_train import run_logged  # noqa: E402
from marin_assets.training.commands import (  # noqa: E402
    EVAL_REPORT_FILE,
    eval_command,
    export_command,
    train_command,
)
from marin_assets.training.levanter_config import WandbSettings, render_train_config  # noqa: E402
from marin_assets.training.memory import plan_run  # noqa: E402
from marin_assets.training.spec import ResourceSpec, RunSpecError, load_run_registry, validate_run  # noqa: E402
from marin_assets.training.train_main import METRICS_FILE, SUMMARY_FILE  # noqa: E402
from marin_resources.process_commands import build_command_and_env  # noqa: E402
from marin_resources.storage.store import MANIFEST_NAME, ArtifactStore, Manifest  # noqa: E402

BUNDLE_FILE = "named_run_bundle.json"
CPU_METRICS = "cpu_metrics.jsonl"
# bf16 compute (8 significant bits: 0.4% a rounding) against the CPU run's f32: the curves' ten-step
# means may differ by this much, relatively. Measured on the v5e chip for nano-shakespeare: 0.2%.
LOSS_TOLERANCE = 0.01
WINDOW = 10


class NamedRunError(RuntimeError):
    """A bundle or run that cannot go ahead; said in one line."""


def committed_checkpoint(store: ArtifactStore, run: str) -> Manifest:
    """The newest committed checkpoint of ``run`` in ``store`` (any code version)."""
    found = []
    for path in store.fs.glob(f"{store.fs_path(store.prefix)}/checkpoint/*/{run}/{MANIFEST_NAME}"):
        uri = store.prefix + path[len(store.fs_path(store.prefix)):].removesuffix(f"/{MANIFEST_NAME}")
        manifest = store.read_manifest(uri)
        if manifest is not None:
            found.append(manifest)
    if not found:
        raise NamedRunError(f"{store.prefix} holds no committed checkpoint of {run!r}: "
                            f"marin materialize checkpoint --partition {run}")
    return max(found, key=lambda m: m.finished_at)


def bundle(store_prefix: str, run: str, out: Path) -> dict:
    """Copy what ``run`` reads (mixture, caches, tokenizer) and the CPU run's metrics into ``out``."""
    store = ArtifactStore(store_prefix)
    checkpoint = committed_checkpoint(store, run)
    inputs = [u for u in checkpoint.upstream if u.asset_key.split("/")[0] in ("mixture", "tokenizer", "tokenized")]
    if out.exists():
        shutil.rmtree(out)
    for ref in inputs:
        source = store.local_path(ref.uri)
        shutil.copytree(source, out / source.relative_to(store.local_path(store.prefix)))
    shutil.copyfile(store.local_path(checkpoint.uri) / METRICS_FILE, out / CPU_METRICS)
    record = {"run": run, "cpu_fingerprint": checkpoint.fingerprint,
              "inputs": {u.asset_key: store.portable(u.uri) for u in inputs},
              "cpu_metrics": {k: checkpoint.metrics.get(k) for k in ("device_kind", "train_loss_last",
                                                                      "eval_loss_last", "tokens_per_second")}}
    (out / BUNDLE_FILE).write_text(json.dumps(record, indent=2))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {len(inputs)} inputs of {run} and its CPU metrics, {size / 2**20:.1f} MiB")
    return record


def run_process(label: str, process, accelerator: str, log: Path) -> float:
    """One of the project's processes to its end; its wall seconds. A held chip is one line, exit 2."""
    launch = build_command_and_env(process, accelerator=accelerator)
    started = time.time()
    run_logged(label, launch.command, launch.env, log, program="named_run")
    return time.time() - started


def train_losses(path: Path) -> dict[int, float]:
    """Step -> training loss of a run's metrics.jsonl (the latest attempt's record of each step)."""
    losses = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("step") is not None and record.get("loss") is not None:
            losses[int(record["step"])] = float(record["loss"])
    return losses


def compare_curves(cpu: dict[int, float], tpu: dict[int, float]) -> dict:
    """The two loss curves on their common steps: step 0, the largest relative gap of their ten-step
    means, and the last window's; ``within`` when every window is inside LOSS_TOLERANCE."""
    steps = sorted(set(cpu) & set(tpu))
    if not steps:
        raise NamedRunError("the CPU and TPU runs share no logged step")
    windows = [steps[i:i + WINDOW] for i in range(0, len(steps), WINDOW)]
    gaps = []
    for window in windows:
        a = sum(cpu[s] for s in window) / len(window)
        b = sum(tpu[s] for s in window) / len(window)
        gaps.append(abs(b - a) / a)
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {"steps": len(steps), "step0": {"cpu": cpu[steps[0]], "tpu": tpu[steps[0]]},
            "last": {"cpu": cpu[steps[-1]], "tpu": tpu[steps[-1]]},
            "largest_window_gap": gaps[worst], "at_steps": [windows[worst][0], windows[worst][-1]],
            "last_window_gap": gaps[-1], "tolerance": LOSS_TOLERANCE,
            "within": all(math.isfinite(g) and g <= LOSS_TOLERANCE for g in gaps)}


def run_on_tpu(bundle_dir: Path, out: Path, tpu_type: str, accelerator: str = "tpu") -> dict:
    """``accelerator="cpu"`` rehearses the whole chain on this machine's CPU (no chip needed)."""
    record = json.loads((bundle_dir / BUNDLE_FILE).read_text())
    store = ArtifactStore(str(bundle_dir.resolve()))
    spec = load_run_registry()[record["run"]]
    resources = ResourceSpec(accelerator="tpu", device_count=1, tpu_type=tpu_type) if accelerator == "tpu" \
        else ResourceSpec(accelerator="cpu", device_count=1)
    spec = dataclasses.replace(spec, resources=resources)
    validate_run(spec)
    if spec.fingerprint() != record["cpu_fingerprint"]:
        raise NamedRunError(f"{spec.name} on {tpu_type} has fingerprint {spec.fingerprint()}, the CPU run "
                            f"{record['cpu_fingerprint']}: its identity changed since the bundle was made")
    inputs = {key: store.resolve(uri) for key, uri in record["inputs"].items()}
    mixture = next(uri for key, uri in inputs.items() if key.startswith("mixture/"))
    tokenizer = next(uri for key, uri in inputs.items() if key.startswith("tokenizer/"))
    with store.open(f"{mixture}/data.json") as f:
        data_config = store.resolve(json.load(f))
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(store.local_path(tokenizer) / "tokenizer.json")).get_vocab_size()
    plan = plan_run(spec, vocab, "")  # before the chip is opened: a setting that fits, or one line
    print(f"{spec.name} on {resources.tpu_type or accelerator}: {plan.describe()}", flush=True)
    if out.exists():
        shutil.rmtree(out)  # a run directory left behind would be resumed
    run_dir, eval_dir, hf_dir = out / "run", out / "eval", out / "hf_model"
    for d in (run_dir, eval_dir, hf_dir):
        d.mkdir(parents=True)
    config = render_train_config(spec, data_config, str(store.local_path(tokenizer)), str(run_dir), WandbSettings(),
                                 compute=plan.settings)
    seconds = {
        "train": run_process("training", train_command(config, str(run_dir), final_eval=True,
                                                        final_eval_examples=spec.final_eval_examples,
                                                        fused_loss=plan.settings.fused_loss),
                             accelerator, out / "train_output.log"),
        "eval": run_process("evaluation", eval_command(config, str(eval_dir),
                                                       sample_examples=spec.final_eval_examples),
                            accelerator, out / "eval_output.log"),
        "export": run_process("export", export_command(config, str(hf_dir)), accelerator, out / "export_output.log"),
    }
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    evaluation = json.loads((eval_dir / EVAL_REPORT_FILE).read_text())
    curves = compare_curves(train_losses(bundle_dir / CPU_METRICS), train_losses(run_dir / METRICS_FILE))
    result = {
        "run": spec.name, "accelerator": accelerator, "tpu_type": resources.tpu_type, "fingerprint": spec.fingerprint(),
        "compute": plan.metadata(),
        "train": {k: summary.get(k) for k in ("device_kind", "mfu", "tokens_per_second", "first_step_seconds",
                                               "train_loss_first", "train_loss_last", "eval_loss_last",
                                               "final_step", "loss_kernel", "rotary_matmul")},
        "eval": {k: v for k, v in evaluation.items() if not isinstance(v, (list, dict))},
        "hf_model": sorted(p.name for p in hf_dir.iterdir()),
        "seconds": seconds, "cpu": record["cpu_metrics"], "loss_curves": curves,
    }
    (out / "named_run.json").write_text(json.dumps(result, indent=2))
    print(f"{spec.name}: trained on {summary.get('device_kind')} in {seconds['train']:.0f} s "
          f"(MFU {summary.get('mfu') or 0:.1%}), evaluated in {seconds['eval']:.0f} s, exported in "
          f"{seconds['export']:.0f} s; loss curves within {curves['largest_window_gap']:.2%} "
          f"(tolerance {LOSS_TOLERANCE:.0%}): {'yes' if curves['within'] else 'NO'}")
    print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("bundle", help="copy what the run reads out of a store")
    make.add_argument("--store", required=True, help="the store prefix the CPU run was committed in")
    make.add_argument("--out", required=True, type=Path)
    make.add_argument("--run", default="nano-shakespeare")
    go = commands.add_parser("run", help="train, evaluate and export on the TPU; compare with the CPU run")
    go.add_argument("bundle", type=Path)
    go.add_argument("--out", required=True, type=Path)
    go.add_argument("--tpu-type", default="v5litepod-1")
    go.add_argument("--accelerator", choices=("tpu", "cpu"), default="tpu",
                    help="cpu: rehearse the whole chain on this machine's CPU first")
    args = parser.parse_args(argv)
    try:
        if args.command == "bundle":
            return bundle(args.store, args.run, args.out)
        return run_on_tpu(args.bundle, args.out, args.tpu_type, args.accelerator)
    except (NamedRunError, RunSpecError, FileNotFoundError, KeyError) as exc:
        print(f"named_run: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
