import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import data_fixtures  # noqa: E402

from marin_assets.training.spec import ModelSpec, OptimizerSpec, RunSpec  # noqa: E402

MIXTURE = "stdlib-docs"
# Each model family's fields beyond the tiny shape (the families' tests).
FAMILY_MODELS = {
    "llama": {},
    "qwen": {},
    "qwen3": {},
    "olmo2": {},
    "mixtral": {"num_experts": 4, "experts_per_token": 2},
}

# Environment for the training subprocesses when run outside the launcher.
SUBPROCESS_ENV = {
    "JAX_PLATFORMS": "cpu",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "PYTHONUNBUFFERED": "1",
}


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory) -> tuple[str, str]:
    """(cache_root, tokenizer_dir): stdlib docstrings, 512-token byte-level BPE, train/validation caches."""
    os.environ.update({k: v for k, v in SUBPROCESS_ENV.items() if k != "PYTHONUNBUFFERED"})
    out = tmp_path_factory.mktemp("tiny_artifact")
    return data_fixtures.build_tokenized_artifact(data_fixtures.stdlib_docstrings(), out, vocab_size=512)


@pytest.fixture(scope="session")
def tiny_mixture(tiny_artifact) -> dict:
    cache_root, tokenizer_dir = tiny_artifact
    return data_fixtures.single_cache_mixture(MIXTURE, cache_root, tokenizer_dir)


def tiny_spec(name: str = "tiny", *, steps: int = 30, checkpoint_every: int = 1000, **overrides) -> RunSpec:
    """A model small enough that a 30-step CPU run is dominated by JAX compile time."""
    fields = dict(
        name=name,
        model=ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2, seq_len=64),
        mixture=MIXTURE,
        tokenizer=MIXTURE,
        optimizer=OptimizerSpec(learning_rate=1e-2, warmup=0.1, min_lr_ratio=0.1),
        train_batch_size=8,
        num_train_steps=steps,
        steps_per_eval=10_000,
        max_eval_batches=2,
        checkpoint_every=checkpoint_every,
    )
    fields.update(overrides)
    return RunSpec(**fields)
