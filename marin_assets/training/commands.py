"""The training and evaluation processes, as commands a launcher runs (`ProcessCommand`).

Their entry modules and the files they write are defined here, next to the config they read
(`levanter_config.TRAIN_CONFIG_FILE`); a launcher only starts what it is given.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from marin_resources.process_commands import ProcessCommand

TRAIN_MODULE = "marin_assets.training.train_main"
EVAL_MODULE = "marin_assets.training.eval_main"
EXPORT_MODULE = "marin_assets.training.export_main"
EVAL_REPORT_FILE = "eval_report.json"
HARNESS_MODULE = "marin_assets.evaluation.harness_main"
HARNESS_REPORT_FILE = "harness_report.json"


def train_command(train_config_path: str, output_dir: str, *, final_eval: bool = False,
                  final_eval_examples: int | None = None, init_sha256: str | None = None,
                  fused_loss: bool = False) -> ProcessCommand:
    """``train_main --config CFG --output-dir OUT [--final-eval [--final-eval-examples N]]
    [--init-sha256 H]``: train (or resume) into ``output_dir``; with ``final_eval``, then evaluate the
    final checkpoint in the same process (every validation sequence, or ``final_eval_examples`` evenly
    spaced). ``init_sha256``: the content hash the initial weights (the config's ``initialize_from_hf``)
    must have. ``fused_loss``: the loss through the Pallas head-and-cross-entropy kernels (a runtime choice)."""
    args = ("--config", train_config_path, "--output-dir", output_dir) + (("--final-eval",) if final_eval else ())
    args += ("--fused-loss",) if fused_loss else ()
    if final_eval and final_eval_examples is not None:
        args += ("--final-eval-examples", str(final_eval_examples))
    if init_sha256 is not None:
        args += ("--init-sha256", init_sha256)
    return ProcessCommand("train", TRAIN_MODULE, args, output_dir, inputs=(train_config_path,))


def eval_command(train_config_path: str, output_dir: str, *, checkpoint_path: str | None = None,
                 sample_examples: int | None = None, extra_args: Sequence[str] = ()) -> ProcessCommand:
    """``eval_main --config CFG --output OUT/eval_report.json``: evaluate the run's latest checkpoint
    (or ``checkpoint_path``) on every validation sequence, or ``sample_examples`` evenly spaced.
    ``extra_args`` e.g. ``--max-examples N``, ``--prompt TEXT``, ``--eval-set NAME``."""
    args = ["--config", train_config_path, "--output", os.path.join(output_dir, EVAL_REPORT_FILE)]
    args += ["--checkpoint", checkpoint_path] if checkpoint_path else []
    args += ["--sample-examples", str(sample_examples)] if sample_examples is not None else []
    args += list(extra_args)
    return ProcessCommand("eval", EVAL_MODULE, tuple(args), output_dir, inputs=(train_config_path,))


def harness_command(train_config_path: str, harness_config_path: str, output_dir: str, *,
                    checkpoint_path: str | None = None) -> ProcessCommand:
    """``harness_main --config CFG --harness HARNESS --output OUT/harness_report.json``: run an eval
    suite on the run's latest checkpoint (or ``checkpoint_path``). The harness config is a file
    under ``output_dir``, so it travels with the run directory."""
    args = ["--config", train_config_path, "--output", os.path.join(output_dir, HARNESS_REPORT_FILE),
            "--harness", harness_config_path]
    args += ["--checkpoint", checkpoint_path] if checkpoint_path else []
    return ProcessCommand("harness", HARNESS_MODULE, tuple(args), output_dir, inputs=(train_config_path,))


def export_command(train_config_path: str, output_dir: str, *, checkpoint_path: str | None = None,
                   max_shard_bytes: int | None = None) -> ProcessCommand:
    """``export_main --config CFG --output OUT``: the run's latest checkpoint (or ``checkpoint_path``)
    as a Hugging Face model directory in ``output_dir``, checked by loading it with transformers."""
    args = ["--config", train_config_path, "--output", output_dir]
    args += ["--checkpoint", checkpoint_path] if checkpoint_path else []
    args += ["--max-shard-bytes", str(max_shard_bytes)] if max_shard_bytes is not None else []
    return ProcessCommand("export", EXPORT_MODULE, tuple(args), output_dir, inputs=(train_config_path,))
