"""Evaluation process: loss and bits-per-byte per validation set, plus greedy samples, for a checkpoint.

Usage: ``python -m marin_assets.training.eval_main --config OUTPUT_DIR/train_config.yaml
[--checkpoint PATH] --output OUTPUT_DIR/eval_report.json``

Definitions (per validation set, over every sequence of its Levanter validation dataset, the first
``--max-examples``, or ``--sample-examples`` evenly spaced over the set):
- loss = total next-token cross-entropy (nats) / number of predicted tokens, where the predicted
  tokens are those under Levanter's causal loss mask (every position but the last of each sequence).
- bpb = total nats / ln 2 / total UTF-8 bytes of the predicted tokens. A token's byte length is
  Levanter's ``byte_length_of_token`` (bytes of its decoded text; special tokens such as BOS/EOS
  count 0 bytes but their loss is included, as in Levanter's own evaluator). Unlike Levanter's
  ``eval/bpb`` (a token-weighted mean of per-batch ratios), this is one ratio of totals.

Reuses Levanter for the model, checkpoint loading, validation datasets and the per-token loss.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from marin_assets.training.process import exits_when_held, parse_process_args, process_parser
from marin_assets.training.reporting import Reporter, open_reporter
from marin_resources.progress import Throttle, progress_line

DEFAULT_PROMPT_TOKENS = 12
DEFAULT_NUM_SAMPLES = 3
# Batches of validation examples fetched per call of the dataset (see the evaluation loop).
FETCH_BATCHES = 64
REPORT_VERSION = 1
"""Bumped when a change of this module changes what a report holds; a final-eval report written by
the training process (`train_main --final-eval`) is adopted by eval/<run> only at this version."""


def evenly_spaced(total: int, count: int | None) -> list[int]:
    """``count`` indices spread evenly over ``range(total)``, starting at 0 (all of them when ``count``
    is None or at least ``total``). Deterministic, so every run of a sweep scores the same sequences."""
    if count is None or count >= total:
        return list(range(total))
    return [i * total // count for i in range(count)]


def _byte_lengths(tokenizer, vocab_size: int):
    import numpy as np
    from levanter.utils.hf_utils import byte_length_of_token

    lengths = np.zeros((vocab_size,), dtype=np.int32)
    for idx in range(len(tokenizer)):
        lengths[idx] = byte_length_of_token(tokenizer, idx)
    return lengths


def resolve_checkpoint(config, checkpoint_path: str | None = None) -> str:
    """The checkpoint to load: ``checkpoint_path`` (or the run's checkpoint base), or its latest step."""
    from levanter.checkpoint import discover_latest_checkpoint

    trainer = config.trainer
    base = checkpoint_path or trainer.checkpointer.expanded_path(trainer.id)
    resolved = discover_latest_checkpoint(base) or base
    if not os.path.exists(os.path.join(resolved, "metadata.json")) and "://" not in resolved:
        raise FileNotFoundError(f"no Levanter checkpoint at or under {base}")
    return resolved


def load_trained_model(config, checkpoint: str, Vocab):
    """The run's model with the checkpoint's weights, sharded and cast for compute. Call inside
    ``trainer.use_device_mesh()`` and the parameter axis mapping."""
    import equinox as eqx
    import haliax as hax
    import jax
    from levanter.checkpoint import load_checkpoint
    from levanter.utils.jax_utils import use_cpu_device

    with use_cpu_device():
        model = eqx.filter_eval_shape(config.model.build, Vocab, key=jax.random.PRNGKey(0))
        model = load_checkpoint(model, checkpoint, subpath="model", discover_latest=False)
    model = hax.shard_with_axis_mapping(model, config.trainer.parameter_axis_mapping)
    return config.trainer.mp.cast_to_compute(model)


def eval_batch_axis(trainer):
    """The batch axis for evaluation: the train batch, rounded down to a multiple of the device count.
    (Measured on CPU: 512 rows instead of 16 saved the per-call overhead but not the time; the
    logits' softmax over the vocabulary dominates a small run's evaluation.)"""
    import jax
    from haliax import Axis

    size = max(jax.device_count(), trainer.train_batch_size - trainer.train_batch_size % jax.device_count())
    return Axis(trainer.batch_axis, size)


def outside_mesh(fn, *args):
    """``fn(*args)`` in a helper thread, where no device mesh is set (JAX's mesh context is per thread).
    Levanter builds each example with a jit pinned to one CPU device, which JAX refuses inside a mesh of
    several devices ("Received incompatible devices for jitted computation")."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def evaluate_checkpoint(
    config_path: str,
    *,
    checkpoint_path: str | None = None,
    eval_sets: list[str] | None = None,
    max_examples: int | None = None,
    sample_examples: int | None = None,
    prompts: list[str] | None = None,
    max_new_tokens: int = 48,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Compute the eval report for a Levanter checkpoint of the run described by ``config_path``:
    every sequence of each set, its first ``max_examples``, or ``sample_examples`` evenly spaced.
    ``log`` gets a progress line (sequences done) at most every EMIT_EVERY_S."""
    if max_examples is not None and sample_examples is not None:
        raise ValueError("give max_examples (the first N sequences) or sample_examples (N evenly spaced), not both")
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import numpy as np
    from haliax import Axis
    from haliax.partitioning import round_axis_for_partitioning
    from levanter.models.lm_model import LmExample, compute_next_token_loss

    from marin_assets.tokenization.cache_format import name_tokenizer_as_ledgers_do
    from marin_assets.training import jax_compat
    from marin_assets.training.flat_dots import use_flat_dots
    from marin_assets.training.levanter_config import parse_train_config
    from marin_resources.storage.object_stores import install_tensorstore_paths

    install_tensorstore_paths()
    jax_compat.install()  # Levanter on the host's JAX (0.7.2 or a TPU image's 0.10)
    config = parse_train_config(config_path)
    name_tokenizer_as_ledgers_do(config.data)  # the caches' ledgers name it so: no metadata mismatch
    tokenizer = config.data.the_tokenizer
    trainer = config.trainer
    use_flat_dots()  # the products the training process ran, so a report here matches its own
    resolved = resolve_checkpoint(config, checkpoint_path)

    Pos = config.model.Pos
    Batch = eval_batch_axis(trainer)
    batch_size = Batch.size
    compute_mapping = trainer.compute_axis_mapping
    param_mapping = trainer.parameter_axis_mapping
    vocab_size = len(tokenizer)
    report: dict[str, Any] = {"report_version": REPORT_VERSION, "checkpoint_path": resolved}
    if sample_examples is not None:  # absent for other reports, which eval/<run> reads as "not a sample"
        report["sample_examples"] = sample_examples

    with trainer.use_device_mesh(), hax.axis_mapping(param_mapping):
        Vocab = round_axis_for_partitioning(Axis("vocab", vocab_size), compute_mapping)
        model = load_trained_model(config, resolved, Vocab)
        bytes_per_token = hax.named(jnp.asarray(_byte_lengths(tokenizer, Vocab.size)), Vocab)

        @hax.named_jit
        def batch_totals(model, example: LmExample, valid: hax.NamedArray):
            with hax.axis_mapping(compute_mapping):
                losses = compute_next_token_loss(model, example, reduction=None, reduction_axis=())
            mask = example.loss_mask * valid  # padding rows of the last batch have valid == 0
            targets = hax.roll(example.tokens, -1, Pos.name)
            nats = hax.sum(losses * mask).scalar()
            nbytes = hax.sum(bytes_per_token.take("vocab", targets) * mask).scalar()
            return nats, hax.sum(mask).scalar(), nbytes

        datasets = config.data.validation_sets(Pos)
        names = eval_sets or sorted(datasets)
        unknown = sorted(set(names) - set(datasets))
        if unknown:
            raise ValueError(f"eval sets {unknown} not found; validation sets are {sorted(datasets)}")

        def stack_leaf(*leaves):
            if isinstance(leaves[0], hax.NamedArray):
                return hax.named(np.stack([np.asarray(x.array) for x in leaves]), (Batch, *leaves[0].axes))
            return np.stack([np.asarray(x) for x in leaves])

        first_examples: list[np.ndarray] = []
        throttle = Throttle()
        for name in names:
            sync = datasets[name].as_sync_dataset()
            n = len(sync) if max_examples is None else min(max_examples, len(sync))
            if n == 0:
                raise ValueError(f"validation set {name!r} is empty")
            indices = evenly_spaced(n, sample_examples)
            totals = []
            # Examples are fetched a block of batches at a time: each synchronous get_batch runs its own
            # event loop, and per batch that cost more than the model (a loop reset warns with a
            # pretty-printed model each time). Batches are stacked in numpy, so no eager op compiles.
            for block in range(0, len(indices), batch_size * FETCH_BATCHES):
                fetched = outside_mesh(sync.get_batch, indices[block:block + batch_size * FETCH_BATCHES])
                for start in range(0, len(fetched), batch_size):
                    examples = fetched[start:start + batch_size]
                    real = len(examples)
                    examples = examples + [examples[0]] * (batch_size - real)
                    stacked = jax.tree_util.tree_map(stack_leaf, *examples,
                                                     is_leaf=lambda x: isinstance(x, hax.NamedArray))
                    valid = hax.named((np.arange(batch_size) < real).astype(np.int32), Batch)
                    # Kept on the device and summed once: a float() per batch would wait for each.
                    totals.append(batch_totals(model, stacked, valid))
                    if log is not None and throttle.due():
                        done = min(len(indices), block + start + batch_size)
                        log(progress_line(f"eval {name}: {done}/{len(indices)} sequences"))
            total_nats, total_tokens, total_bytes = np.asarray(totals, dtype=np.float64).sum(axis=0).tolist()
            if len(first_examples) < num_samples:
                first = outside_mesh(sync.get_batch, list(range(min(n, num_samples))))
                first_examples += [np.asarray(ex.tokens.array) for ex in first]
            report[f"eval/{name}/loss"] = total_nats / total_tokens
            report[f"eval/{name}/bpb"] = total_nats / math.log(2) / total_bytes if total_bytes else None
            report[f"eval/{name}/tokens"] = int(total_tokens)
            report[f"eval/{name}/bytes"] = int(total_bytes)
            report[f"eval/{name}/sequences"] = len(indices)

        if prompts:
            prompt_ids = [[tokenizer.bos_token_id, *tokenizer(p, add_special_tokens=False)["input_ids"]]
                          for p in prompts]
        else:
            prompt_ids = [list(t[:DEFAULT_PROMPT_TOKENS]) for t in first_examples[:num_samples]]
        samples = []
        for ids in prompt_ids:
            ids = [int(i) for i in ids][: Pos.size - 1]
            generated = greedy_continuation(model, Pos, ids, max_new_tokens, tokenizer.eos_token_id, vocab_size)
            samples.append(
                {
                    "prompt": tokenizer.decode(ids, skip_special_tokens=True),
                    "completion": tokenizer.decode(generated, skip_special_tokens=True),
                }
            )
        report["samples"] = samples
    return report


def _next_token(model, tokens, index, vocab_size: int):
    """The most likely token after position ``index`` (vocabulary padding rows ignored)."""
    import jax.numpy as jnp
    from levanter.layers.attention import AttentionMask

    return jnp.argmax(model(tokens, attn_mask=AttentionMask.causal()).array[index, :vocab_size])


def greedy_continuation(model, Pos, prompt: list[int], new_tokens: int, eos: int, vocab_size: int) -> list[int]:
    """Greedy continuation of ``prompt`` with Levanter's model: at most ``new_tokens``, stopping at
    EOS or the end of the context. Call inside the device mesh and parameter axis mapping."""
    import haliax as hax
    import jax.numpy as jnp
    import numpy as np

    next_token = _compiled_next_token()
    buffer = np.full((Pos.size,), eos, dtype=np.int32)
    buffer[:len(prompt)] = prompt
    generated: list[int] = []
    position = len(prompt)
    while len(generated) < new_tokens and position < Pos.size:
        # The index goes in as an array: a Python int is static to named_jit, one compile per position.
        token = int(next_token(model, hax.named(jnp.asarray(buffer), Pos), jnp.asarray(position - 1), vocab_size))
        if token == eos:
            break
        buffer[position] = token
        generated.append(token)
        position += 1
    return generated


@functools.cache
def _compiled_next_token():
    """`_next_token` under named_jit, made once per process so every prompt reuses its compilation."""
    import haliax as hax

    return hax.named_jit(_next_token)


def write_report(report: dict[str, Any], path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    parser = process_parser(__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the run's Levanter train config YAML")
    parser.add_argument("--checkpoint", help="checkpoint dir (or a parent to search); default: the run's latest")
    parser.add_argument("--output", required=True, help="where to write the JSON report")
    parser.add_argument("--eval-set", action="append", dest="eval_sets", help="validation set name (repeatable)")
    parser.add_argument("--max-examples", type=int, help="evaluate at most this many sequences per set (the first)")
    parser.add_argument("--sample-examples", type=int,
                        help="evaluate this many sequences per set, evenly spaced over it (the same for every run)")
    parser.add_argument("--prompt", action="append", dest="prompts", help="sampling prompt (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parse_process_args(parser, argv)
    reporter: Reporter
    with exits_when_held("eval_main"), open_reporter() as reporter:
        report = evaluate_checkpoint(
            args.config,
            checkpoint_path=args.checkpoint,
            eval_sets=args.eval_sets,
            max_examples=args.max_examples,
            sample_examples=args.sample_examples,
            prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            log=reporter.log,
        )
        write_report(report, args.output)
        for key, value in report.items():
            if key.endswith(("/loss", "/bpb")):
                reporter.log(f"{key} = {value:.4f}")
        metadata = {k: v for k, v in report.items() if k != "samples"}
        metadata["samples"] = report["samples"]
        metadata["eval_report_path"] = os.path.abspath(args.output)
        reporter.materialization(metadata, asset_key=args.asset_key)


if __name__ == "__main__":
    main()
    # Without the interpreter's teardown of JAX and Levanter, as train_main ends (process_exit.py).
    from marin_resources.process_exit import exit_now

    exit_now(0)
