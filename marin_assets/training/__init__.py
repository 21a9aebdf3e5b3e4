"""Training and evaluation of Levanter language models from typed run specs.

Importing this package is cheap: JAX/Levanter are only imported inside the
``train_main``/``eval_main`` subprocesses and inside functions that need them.
"""

from marin_assets.training.spec import (
    ModelSpec,
    OptimizerSpec,
    ResourceSpec,
    RunSpec,
    RunSpecError,
    load_run_registry,
)

__all__ = [
    "ModelSpec",
    "OptimizerSpec",
    "ResourceSpec",
    "RunSpec",
    "RunSpecError",
    "load_run_registry",
]
