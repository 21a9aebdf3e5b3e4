"""`marin demo` end to end, as a user runs it on a fresh clone: the Shakespeare chain to
eval[nano-shakespeare], then the built-in `demo` sweep (3 budgets x 3 model sizes, each a few
seconds of training) to its scaling fit; run again, it builds nothing. Then the default suite on the
demo's model, whose word-order margin over chance docs/evaluation.md states."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from marin_assets.evaluation.assets import HARNESS_EVAL_VERSION
from marin_assets.evaluation.suites import margin_over_chance
from marin_assets.export.assets import HF_MODEL_VERSION, loading_snippet
from marin_assets.scaling_sweeps.assets import SCALING_FIT_VERSION
from marin_assets.scaling_sweeps.config import load_sweeps, plan_sweep
from marin_assets.training.train_main import FINAL_EVAL_FILE
from marin_resources.storage.store import ArtifactStore

pytestmark = [pytest.mark.slow, pytest.mark.heaviest]
REPO = Path(__file__).resolve().parents[2]


def demo(env) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "demo"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_demo_reaches_a_scaling_fit_and_is_a_noop_the_second_time(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARIN_")}
    env.update({"DAGSTER_HOME": str(tmp_path / "home"), "MARIN_PREFIX": str(tmp_path / "store")})
    first = demo(env)
    assert "scaling_fit/demo" in first.stdout
    # The named run's training is not silent: where its process logs, then step, loss, tokens/s and an ETA.
    assert "checkpoint, eval [nano-shakespeare]: train process output: " in first.stdout, first.stdout[-3000:]
    assert re.search(r"checkpoint, eval \[nano-shakespeare\]: step \d+/300 loss [\d.]+ tokens/s \d+ .*eta ",
                     first.stdout), first.stdout[-3000:]

    store = ArtifactStore(str(tmp_path / "store"))
    fit = store.find("scaling_fit/demo", SCALING_FIT_VERSION, None)
    assert fit is not None, first.stdout[-3000:]
    files = {f.path for f in fit.files}
    result = json.loads(store.local_path(f"{fit.uri}/fit.json").read_text())
    assert {"fit.json", "fit.png", "joint.png"} <= files and len(result["runs"]) == 9
    assert result["forecast_method"] == "joint" and {"E", "A", "B", "alpha", "beta"} <= set(result["joint_fit"])
    # The envelope: a sane fit through three interior optima, or why not (with three runs a budget the
    # residual bootstrap cannot vary, so even interior optima are refused, for zero-width intervals).
    if "law" in result["fit"]:
        assert all(o["interior"] for o in result["fit"]["optima"]) and result["fit"]["law"]["E"] > 0
        assert fit.metrics["envelope"].startswith("fitted through 3 interior optima")
    else:
        assert result["fit"]["error"].startswith(("not enough interior optima: ", "envelope refused: "))
        assert fit.metrics["envelope"] == f"not fitted: {result['fit']['error']}"
    assert fit.metrics["runs"] == 9
    # The named run's checkpoint stays its own asset: the sweep's nine are partitions of sweep_checkpoint/demo.
    checkpoint = store.find("checkpoint", "v1", "nano-shakespeare")
    assert checkpoint is not None
    # Its evaluation is the report its training process wrote (no second Levanter process).
    final = json.loads((Path(checkpoint.uri) / FINAL_EVAL_FILE).read_text())
    evaluation = store.find("eval", "v1", "nano-shakespeare")
    assert evaluation.metrics["eval/shakespeare/loss"] == final["eval/shakespeare/loss"]
    assert not (Path(evaluation.uri) / "eval_output.log").exists()  # the eval process's log
    sweep = load_sweeps()["demo"]
    runs = [r.spec.name for r in plan_sweep(sweep).fit_runs()]
    assert len(runs) == 9 and all(store.find("sweep_checkpoint/demo", "v1", r) is not None for r in runs)
    # Each sweep eval is the training process's report on the sweep's fixed sample of the split.
    for run in runs:
        evaluation = store.find("sweep_eval/demo", "v1", run)
        assert evaluation.metrics["eval/shakespeare/sequences"] == sweep.eval_examples, run
        assert not (Path(evaluation.uri) / "eval_output.log").exists(), run

    # The named run in Hugging Face format, where the demo says, loaded with the lines it prints.
    export = store.find("hf_model", HF_MODEL_VERSION, "nano-shakespeare")
    assert export is not None and f"model:      {export.uri}" in first.stdout
    assert export.metrics["greedy_matches"] is True and export.metrics["max_abs_logit_difference"] <= 1e-4
    snippet = loading_snippet(export.uri)
    assert all(line in first.stdout for line in snippet.splitlines())
    scope: dict = {}
    exec(snippet, scope)  # it prints the model's continuation of a line of Hamlet
    prompt, output = scope["prompt"][0].tolist(), scope["output"][0].tolist()
    assert prompt[0] == scope["tokenizer"].bos_token_id and scope["tokenizer"].eos_token_id not in prompt
    assert output[:len(prompt)] == prompt and output[len(prompt)] != scope["tokenizer"].eos_token_id

    # One identity per artifact: everything the demo committed is what `marin status` wants now. Status
    # finds an artifact by the fingerprint of its spec's identity, the one the asset committed; an
    # identity that depends on more than the code (a tokenizer's pinned corpora) would show here as
    # missing or stale if the two ever computed it differently.
    status = subprocess.run([sys.executable, "-m", "marin_assets.cli", "status", "--json"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert status.returncode == 0, status.stderr[-3000:]
    states = {(s["asset_key"], s["partition"]): s for s in json.loads(status.stdout)}
    committed = list((tmp_path / "store").rglob(".artifact.json"))
    assert len(committed) >= 30
    for path in committed:
        manifest = json.loads(path.read_text())
        state = states.get((manifest["asset_key"], manifest["partition"]))
        assert state is not None and state["state"] == "fresh", (manifest["asset_key"], manifest["partition"], state)
        assert Path(state["uri"]).resolve() == path.parent.resolve()  # this very artifact, not another version

    again = demo(env)
    assert again.stdout.count("ok: 0 run(s)") == 2, again.stdout[-3000:]

    # docs/evaluation.md: on the default suite the demo's model beats chance on shakespeare_word_order
    # by 0.66 (acc - 2 x stderr - chance, the margin `beats_chance` requires to be positive).
    suite = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", "harness_eval", "--partition",
                            "nano-shakespeare"], env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert suite.returncode == 0, suite.stdout[-4000:] + suite.stderr[-4000:]
    harness = store.find("harness_eval", HARNESS_EVAL_VERSION, "nano-shakespeare")
    chance = harness.metrics["shakespeare_word_order/chance"]
    assert chance == 0.25 and harness.metrics["shakespeare_word_order/n"] == 400
    margin = margin_over_chance(harness.metrics, "shakespeare_word_order", chance)
    assert margin > 0.6, harness.metrics
