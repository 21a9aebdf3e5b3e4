"""docs/your-data.md, run as written: its `bash` blocks, in order, in one shell, in an empty directory
holding a folder of text files (`my-texts/`), with no MARIN_* variable and no DAGSTER_HOME set."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.heaviest]
REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "your-data.md"


def bash_blocks(markdown: str) -> list[str]:
    """The page's ```bash fenced blocks; other blocks (yaml, text) are shown, not run."""
    return re.findall(r"^```bash\n(.*?)^```$", markdown, flags=re.MULTILINE | re.DOTALL)


def write_corpus(folder: Path) -> int:
    """Docstrings of Python's standard library, ten to a file, keeping the files the default filters
    keep (which docstrings exist depends on the interpreter): real prose the test writes itself."""
    import polars as pl

    sys.path.insert(0, str(REPO / "tests" / "training"))
    import data_fixtures

    from marin_assets.curation.filters import FilterConfig, apply_filters

    docs = data_fixtures.stdlib_docstrings()
    folder.mkdir()
    written = 0
    for start in range(0, len(docs), 10):
        text = "\n\n".join(docs[start:start + 10])
        one = pl.DataFrame({"id": ["x"], "text": [text], "source": ["s"], "source_id": ["x"], "metadata": ["{}"]})
        if apply_filters(one, FilterConfig()).kept.height == 1:
            # Every fourth file one folder down: the source's glob reads them at any depth.
            path = folder / ("nested" if written % 4 == 3 else "") / f"part{written:03d}.txt"
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            written += 1
    return written


def test_the_walkthrough_runs_as_written(tmp_path):
    blocks = bash_blocks(PAGE.read_text())
    assert len(blocks) >= 5 and "marin init" in blocks[0], blocks
    assert any("marin materialize harness_eval --partition my-first-run" in block for block in blocks), blocks
    files = write_corpus(tmp_path / "my-texts")
    assert files >= 20, f"only {files} files of docstrings pass the default filters"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MARIN_", "DAGSTER_"))}
    # `marin` as the page's reader has it: the environment's bin/ on PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    script = "set -euo pipefail\n" + "\n".join(f"echo '>>> block {i}'\n{block}" for i, block in enumerate(blocks))
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    project = tmp_path / "my-project"
    assert (project / "marin.yaml").is_file() and (project / ".dagster_home").is_dir()
    store = project / "store"  # the project file's `store: store`, beside it
    manifests = list(store.glob("eval/v1-*/my-first-run/.artifact.json"))
    assert len(manifests) == 1, out[-4000:]
    metrics = json.loads(manifests[0].read_text())["metrics"]
    assert metrics["eval/my_text/loss"] > 0 and metrics["eval/my_text/tokens"] > 0, metrics
    # Every file was read (the nested ones too), into the one source's shards.
    raw = list(store.glob("raw/my_text/v1-*/*/.artifact.json"))
    assert sum(len(json.loads(m.read_text())["files"]) for m in raw) >= files
    # lm-eval on its own held-out text, offline: the task made from them and the run's harness evaluation.
    (harness,) = store.glob("harness_eval/v1-*/my-first-run/.artifact.json")
    results = json.loads(harness.read_text())["metrics"]
    (task,) = store.glob("eval_task/my_text_word_order/**/.artifact.json")
    items = json.loads(task.read_text())["metrics"]["items"]
    assert results["my_text_word_order/n"] == min(200, items) > 0 and 0 <= results["my_text_word_order/acc"] <= 1
    assert results["eval/my_text/bpb"] > 0 and results["my_text_word_order/acc_stderr"] > 0, results
    # The run and its evaluations read its own data only: nothing built-in was curated or tokenized for them.
    built = {path.relative_to(store).parts[0] + "/" + path.relative_to(store).parts[1]
             for path in store.glob("*/*") if path.is_dir()}
    assert not [key for key in built if "shakespeare" in key or "installed_packages" in key], built
    assert not (store / "raw" / "shakespeare").exists() and not (store / "mixture" / "shakespeare").exists()
    # Training reported its progress; the rerun built nothing; the verified lineage reached the files.
    assert re.search(r"checkpoint, eval \[my-first-run\]: step \d+/100 loss [\d.]+", out), out[-4000:]
    assert "ok: 0 run(s)" in out and f"prefix {store}" in out, out[-4000:]
    assert "fresh    eval[my-first-run]" in out, out[-4000:]
    assert "external/my_text[nested+part003.txt]" in out and "verified" in out, out[-4000:]
