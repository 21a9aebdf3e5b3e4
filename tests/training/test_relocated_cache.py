"""A token cache and its tokenizer moved to another place train there (issue #30): the ledger names the
tokenizer by its files' hash, and train_main gives the tokenizer it loads that name, so Levanter's
metadata check passes with the tokenizer found at the new place."""

import hashlib
import os
import shutil
import subprocess
import sys

import data_fixtures
import pytest
from conftest import MIXTURE, SUBPROCESS_ENV, tiny_spec

pytestmark = pytest.mark.slow


def test_a_moved_cache_trains_with_the_tokenizer_found_there_and_no_metadata_mismatch(tmp_path):
    from marin_assets.tokenization.cache import build_levanter_cache_from_documents
    from marin_assets.tokenization.cache_config import CacheConfig
    from marin_assets.training.levanter_config import WandbSettings, render_train_config

    texts = data_fixtures.stdlib_docstrings()[:300]
    built = tmp_path / "built"
    tokenizer = data_fixtures.train_byte_bpe_tokenizer(texts, built / "tokenizer", 512)
    build_levanter_cache_from_documents(((hashlib.sha256(t.encode()).hexdigest(), t) for t in texts), tokenizer,
                                        str(built / "cache"), CacheConfig(validation_fraction=0.1))
    moved = tmp_path / "moved"
    shutil.copytree(built, moved, symlinks=True)
    shutil.rmtree(built)  # nothing may still point at where it was built

    mixture = data_fixtures.single_cache_mixture(MIXTURE, str(moved / "cache"), str(moved / "tokenizer"))
    run = tmp_path / "run"
    config = render_train_config(tiny_spec(steps=3), mixture, str(moved / "tokenizer"), str(run), WandbSettings())
    proc = subprocess.run([sys.executable, "-m", "marin_assets.training.train_main", "--config", config,
                           "--output-dir", str(run)], env={**os.environ, **SUBPROCESS_ENV},
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "Metadata mismatch" not in log and "Building cache" not in log, log[log.find("Metadata mismatch"):][:2000]
    assert '"final_step": 3' in log

