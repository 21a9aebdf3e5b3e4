"""Export to Hugging Face (`export_main`): a tiny trained run written as a Hugging Face directory and
read back by transformers (Flax; torch is not installed), as a client would."""

import json
import os
import subprocess
import sys
from pathlib import Path

import data_fixtures
import numpy as np
import pytest
from conftest import SUBPROCESS_ENV, tiny_spec

from marin_assets.export.assets import GENERATION_PROMPT, loading_snippet
from marin_assets.training.export_main import (
    CHECK_NEW_TOKENS,
    CHECK_PROMPT_TOKENS,
    EXPORT_ERROR_FILE,
    EXPORT_REPORT_FILE,
    LOGIT_TOLERANCE,
    shard_weights,
)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DOCUMENTED_PATH = "local_store/hf_model/v2-<fingerprint>/nano-shakespeare"


def run_module(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], env={**os.environ, **SUBPROCESS_ENV},
                          capture_output=True, text=True, timeout=900, cwd=cwd)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_artifact, tiny_mixture) -> Path:
    """A 30-step tiny run's directory: its config and checkpoints."""
    from marin_assets.training.levanter_config import build_train_config, write_train_config

    _, tokenizer_dir = tiny_artifact
    out = tmp_path_factory.mktemp("export_run")
    config = write_train_config(build_train_config(tiny_spec(steps=30, watch_every=0), tiny_mixture, tokenizer_dir,
                                                   str(out)), out / "train_config.yaml")
    proc = run_module("marin_assets.training.train_main", "--config", config, "--output-dir", str(out), cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def exported(trained_run) -> tuple[Path, dict]:
    out = trained_run / "hf"
    proc = run_module("marin_assets.training.export_main", "--config", str(trained_run / "train_config.yaml"),
                      "--output", str(out), cwd=trained_run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / EXPORT_REPORT_FILE).read_text())


def test_the_export_is_a_hugging_face_directory_that_levanter_and_transformers_agree_on(exported):
    out, report = exported
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert report["checkpoint_path"].endswith("step-29") and report["dtype"] == "float32"
    assert report["parameters"] == tiny_spec().model.parameter_count(512)
    # Checked by the export itself: Flax's logits on 4 validation sequences, greedy generation.
    assert report["check_sequences"] == 4 and report["max_abs_logit_difference"] <= LOGIT_TOLERANCE
    assert report["greedy_matches"] is True


def test_a_client_loads_it_and_generates_what_levanter_generated(exported, tiny_artifact):
    import jax.numpy as jnp
    from transformers import AutoTokenizer, FlaxLlamaForCausalLM

    out, report = exported
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = FlaxLlamaForCausalLM.from_pretrained(out, dtype=jnp.float32)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (report["bos_token_id"], report["eos_token_id"])
    prompt = report["greedy_prompt"]
    assert len(prompt) == CHECK_PROMPT_TOKENS
    generated = model.generate(jnp.asarray([prompt]), max_new_tokens=CHECK_NEW_TOKENS, do_sample=False,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    tokens = generated.sequences[0, len(prompt):].tolist()
    tokens = tokens[:tokens.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in tokens else tokens
    assert tokens == report["greedy_tokens"]  # Levanter's greedy sampler, in the export process


def test_its_tokenizer_encodes_documents_as_the_token_cache_did_but_for_the_closing_eos(exported, tiny_artifact,
                                                                                         tmp_path):
    """1,000 documents through the pipeline's own cache builder, against `AutoTokenizer(text)`: the same
    rows, BOS first, without the EOS that closed each document in the cache."""
    from levanter.store.cache import TreeCache
    from transformers import AutoTokenizer

    from marin_assets.tokenization.cache import build_levanter_cache_from_documents
    from marin_assets.tokenization.cache_config import CacheConfig

    out, _ = exported
    _, tokenizer_dir = tiny_artifact
    # The fixture's docstrings cut into paragraphs: real text, 1,000 documents.
    docs = [p for doc in data_fixtures.stdlib_docstrings() for p in doc.split("\n\n") if p.strip()][:1000]
    assert len(docs) == 1000
    build_levanter_cache_from_documents(((f"doc{i}", text) for i, text in enumerate(docs)), tokenizer_dir,
                                        str(tmp_path / "cache"), CacheConfig(validation_fraction=0.0))
    cache = TreeCache.load(str(tmp_path / "cache" / "train"), {"input_ids": np.zeros((0,), dtype=np.int32)})
    rows = [list(r["input_ids"]) for r in cache.get_batch_sync(list(range(len(cache))))]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert rows == [[*ids, tokenizer.eos_token_id] for ids in tokenizer(docs)["input_ids"]]


def test_the_documented_lines_continue_a_prompt_instead_of_starting_after_its_end(exported, capsys):
    """The lines docs/training.md shows (and the demo prints), run as written on the export: the
    prompt is BOS + text with no EOS, and greedy generation continues it."""
    out, _ = exported
    assert f"```python\n{loading_snippet(DOCUMENTED_PATH)}\n```" in (REPO / "docs" / "training.md").read_text()
    scope: dict = {}
    exec(loading_snippet(str(out)), scope)
    tokenizer, prompt, output = scope["tokenizer"], scope["prompt"][0].tolist(), scope["output"][0].tolist()
    assert prompt[0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in prompt
    assert prompt == tokenizer(GENERATION_PROMPT)["input_ids"] and output[:len(prompt)] == prompt
    assert len(output) > len(prompt) and output[len(prompt)] != tokenizer.eos_token_id
    printed = capsys.readouterr().out
    assert printed.startswith(GENERATION_PROMPT) and len(printed.strip()) > len(GENERATION_PROMPT)


def test_a_run_continued_from_the_export_starts_at_the_loss_the_run_ended_with(trained_run, exported, tiny_artifact,
                                                                              tiny_mixture, tmp_path):
    """Import (`init_from`) of the export: the continued run's first step is the trained model's loss."""
    from marin_assets.curation.content_hashes import ContentHashCache
    from marin_assets.training.init_weights import resolve_path
    from marin_assets.training.levanter_config import build_train_config, write_train_config
    from marin_assets.training.spec import InitFrom
    from marin_assets.training.train_main import METRICS_FILE, SUMMARY_FILE

    out_hf, _ = exported
    _, tokenizer_dir = tiny_artifact
    with ContentHashCache(tmp_path / "hashes.sqlite") as hashes:
        weights = resolve_path(str(out_hf), hashes)
    out = tmp_path / "continued"
    spec = tiny_spec("continued", steps=2, watch_every=0, init_from=InitFrom(path=str(out_hf)))
    config = write_train_config(build_train_config(spec, tiny_mixture, tokenizer_dir, str(out), init_weights=weights),
                                out / "train_config.yaml")
    proc = run_module("marin_assets.training.train_main", "--config", config, "--output-dir", str(out),
                      "--init-sha256", weights.sha256, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((out / METRICS_FILE).read_text().splitlines()[0])["loss"]
    started = json.loads((trained_run / SUMMARY_FILE).read_text())["train_loss_first"]
    # The first step scores another batch than the trained run's last, so it is compared with the spread
    # of the trained run's own last losses (about +-0.1 here), not with one of them.
    trained = [json.loads(line)["loss"] for line in (trained_run / METRICS_FILE).read_text().splitlines()]
    tail = trained[-10:]
    margin = (max(tail) - min(tail)) / 2
    assert min(tail) - margin <= first <= max(tail) + margin, (first, tail)
    assert started - first > 1.0  # nowhere near a fresh model's loss


def test_a_missing_checkpoint_is_one_line_and_exit_2(trained_run, tmp_path):
    out = tmp_path / "hf"
    proc = run_module("marin_assets.training.export_main", "--config", str(trained_run / "train_config.yaml"),
                      "--checkpoint", str(trained_run / "checkpoints" / "step-7"), "--output", str(out),
                      cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = (out / EXPORT_ERROR_FILE).read_text().strip()
    assert "step-7" in line and "\n" not in line
    assert not (out / "model.safetensors").exists()


def test_weights_are_cut_into_shards_of_at_most_the_limit():
    assert shard_weights({"a": 4, "b": 4, "c": 4}, 8) == [["a", "b"], ["c"]]
    assert shard_weights({"big": 20, "small": 1}, 8) == [["big"], ["small"]]  # an oversize tensor stands alone
    assert shard_weights({"a": 4}, 8) == [["a"]]


def test_a_family_other_than_llama_is_refused_before_any_weight_is_read(trained_run, tmp_path):
    """Qwen's config class subclasses Llama's, but its weights (biases) are not transformers' Llama.
    (`export_main` turns an ExportError into its one line and exit 2, as the test above shows.)"""
    import yaml

    from marin_assets.training.export_main import ExportError, export_checkpoint

    config = yaml.safe_load((trained_run / "train_config.yaml").read_text())
    config["model"]["type"] = "qwen"
    (tmp_path / "train_config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ExportError, match=r"QwenConfig is not supported for export \(Llama only\)$"):
        export_checkpoint(str(tmp_path / "train_config.yaml"), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
