"""Export process: a run's Levanter checkpoint as a Hugging Face model directory, checked by loading
it back with transformers.

Usage: ``python -m marin_assets.training.export_main --config RUN_DIR/train_config.yaml
[--checkpoint PATH] --output EXPORT_DIR [--max-shard-bytes N]``

Writes ``config.json`` (transformers' ``LlamaConfig`` of the run's model, with the tokenizer's
BOS/EOS ids), ``generation_config.json``, the weights as ``model.safetensors`` (float32, PyTorch
key names; ``model-0000i-of-0000n.safetensors`` and an index past ``--max-shard-bytes``), the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and ``export_report.json``.

The exported tokenizer adds BOS only (a post-processor on the tokenizer): ``AutoTokenizer(text)``
is a token cache row without its closing EOS, so a prompt reads as the start of a document and
``generate`` continues it (with EOS appended, greedy generation would start after the end of one).
Before it finishes, the process loads the directory with transformers' Flax Llama and compares it
with Levanter's model on the run's first validation sequences (largest absolute logit difference)
and on greedy generation from their first tokens; the report records both, and a disagreement
beyond `LOGIT_TOLERANCE` fails the export.

Reuses Levanter for the model, the checkpoint and the state dict's key names (its HF converter
would fetch a reference config from the Hub, which a machine without network access cannot reach).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from marin_assets.training.process import exits_when_held, input_errors, parse_process_args, process_parser
from marin_assets.training.reporting import Reporter, open_reporter

# The export's artifact, here rather than in export/assets.py: a training run may start from another
# run's export (`init_from`), and export/ builds on training/, not the other way round.
HF_MODEL_KEY = "hf_model"
HF_MODEL_VERSION = "v2"  # v2: the tokenizer adds BOS only (v1 added EOS to every prompt)
EXPORT_REPORT_FILE = "export_report.json"
EXPORT_ERROR_FILE = "export_error.txt"
"""Written instead of the export when the input is wrong: the one line the asset reports."""
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
LOGIT_TOLERANCE = 1e-4
CHECK_SEQUENCES = 4
CHECK_NEW_TOKENS = 20
CHECK_PROMPT_TOKENS = 8
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message names the path and what is wrong."""


def shard_weights(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in file order, cut into shards of at most ``max_shard_bytes`` (a tensor larger
    than that is a shard of its own)."""
    if max_shard_bytes <= 0:
        raise ExportError(f"max shard size must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    filled = 0
    for name in sorted(sizes):
        if shards[-1] and filled + sizes[name] > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += sizes[name]
    return shards


def write_safetensors(state: dict[str, Any], out: Path, max_shard_bytes: int) -> list[str]:
    """The weights as one safetensors file, or shards and their index as transformers writes them."""
    from safetensors.numpy import save_file

    shards = shard_weights({name: array.nbytes for name, array in state.items()}, max_shard_bytes)
    metadata = {"format": "pt"}  # PyTorch key names and layouts: what every client expects
    if len(shards) == 1:
        save_file({name: state[name] for name in shards[0]}, out / SAFETENSORS_FILE, metadata=metadata)
        return [SAFETENSORS_FILE]
    files, weight_map = [], {}
    for number, names in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: state[name] for name in names}, out / file, metadata=metadata)
        files.append(file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": sum(a.nbytes for a in state.values())}, "weight_map": weight_map}
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return [*files, SAFETENSORS_INDEX]


def save_tokenizer(tokenizer, out: Path) -> None:
    """The run's tokenizer, adding BOS only on encode: a prompt starts as the cache's documents did
    (BOS + text), and ends without their EOS, so that `generate` continues it."""
    from marin_assets.tokenization.tokenizer import bos_only_template

    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    if bos is None or eos is None:
        raise ExportError("the run's tokenizer has no BOS or EOS token; the cache framed documents with both")
    tokenizer.backend_tokenizer.post_processor = bos_only_template(bos, tokenizer.bos_token_id)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(add_bos_token=True, add_eos_token=False)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def export_checkpoint(config_path: str, output_dir: str, *, checkpoint_path: str | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write the run's checkpoint (its latest, or ``checkpoint_path``) to ``output_dir`` in Hugging
    Face format, check it with transformers, and return the report."""
    import equinox as eqx
    import haliax as hax
    import jax
    import numpy as np
    from haliax import Axis
    from haliax.partitioning import round_axis_for_partitioning
    from haliax.state_dict import to_torch_compatible_state_dict
    from levanter.checkpoint import load_checkpoint
    from levanter.models.llama import LlamaConfig
    from levanter.utils.jax_utils import use_cpu_device

    from marin_assets.tokenization.cache_format import name_tokenizer_as_ledgers_do
    from marin_assets.training import jax_compat
    from marin_assets.training.eval_main import resolve_checkpoint
    from marin_assets.training.levanter_config import parse_train_config
    from marin_resources.storage.object_stores import install_tensorstore_paths

    install_tensorstore_paths()
    jax_compat.install()  # Levanter on the host's JAX (0.7.2 or a TPU image's 0.10)
    config = parse_train_config(config_path)
    name_tokenizer_as_ledgers_do(config.data)  # the validation caches' ledgers name it so
    if type(config.model) is not LlamaConfig:  # Qwen's configs subclass it, but are not transformers' Llama
        raise ExportError(f"{config_path}: model type {type(config.model).__name__} is not supported for export "
                          "(Llama only)")
    tokenizer = config.data.the_tokenizer
    try:
        resolved = resolve_checkpoint(config, checkpoint_path)
    except FileNotFoundError as exc:
        raise ExportError(str(exc)) from None
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)

    trainer = config.trainer
    with trainer.use_device_mesh(), hax.axis_mapping(trainer.parameter_axis_mapping):
        # The vocabulary as training built it (rounded up for the mesh): the tokenizer may be smaller.
        Vocab = round_axis_for_partitioning(Axis("vocab", len(tokenizer)), trainer.compute_axis_mapping)
        with use_cpu_device():
            shape = eqx.filter_eval_shape(config.model.build, Vocab, key=jax.random.PRNGKey(0))
            model = load_checkpoint(shape, resolved, subpath="model", discover_latest=False)
        state = {name: np.asarray(array, dtype=np.float32) if np.issubdtype(np.asarray(array).dtype, np.floating)
                 else np.asarray(array) for name, array in to_torch_compatible_state_dict(model).items()}
        weight_files = write_safetensors(state, out, max_shard_bytes)
        vocab_size = Vocab.size

    hf_config = config.model.to_hf_config(vocab_size)
    hf_config.bos_token_id, hf_config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.torch_dtype = "float32"
    hf_config.save_pretrained(out)
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.eos_token_id).save_pretrained(out)
    save_tokenizer(tokenizer, out)

    parameters = int(sum(array.size for array in state.values()))
    report: dict[str, Any] = {
        "checkpoint_path": resolved, "parameters": parameters, "dtype": "float32",
        "weight_bytes": int(sum(array.nbytes for array in state.values())), "weight_files": weight_files,
        "vocab_size": vocab_size, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
    }
    with trainer.use_device_mesh(), hax.axis_mapping(trainer.parameter_axis_mapping):
        report.update(check_with_transformers(config, model, out, tokenizer, sharded=len(weight_files) > 1))
    (out / EXPORT_REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report


def check_with_transformers(config, model, out: Path, tokenizer, *, sharded: bool) -> dict[str, Any]:
    """Load the export with transformers' Flax Llama and compare it with Levanter's model: logits on
    the first validation sequences, and greedy generation from their first tokens."""
    import haliax as hax
    import jax.numpy as jnp
    import numpy as np
    from levanter.layers.attention import AttentionMask
    from levanter.utils.jax_utils import local_cpu_mesh

    from marin_assets.training.eval_main import greedy_continuation

    if sharded:
        # transformers' Flax loader reads sharded safetensors only through torch, which is not installed.
        return {"client_check": "skipped: sharded weights need torch to load in transformers' Flax"}
    from transformers import FlaxLlamaForCausalLM

    client = FlaxLlamaForCausalLM.from_pretrained(out, dtype=jnp.float32)
    Pos = config.model.Pos
    datasets = config.data.validation_sets(Pos)
    if not datasets:
        return {"client_check": "skipped: the run has no validation set"}
    name = sorted(datasets)[0]
    sync = datasets[name].as_sync_dataset()
    # Levanter builds examples on the CPU device (a sharding constraint inside a jit); under the run's
    # device mesh, JAX 0.10 refuses that on a TPU, so they are read under the CPU mesh, as its loader does.
    with local_cpu_mesh():
        sequences = [np.asarray(example.tokens.array)
                     for example in sync.get_batch(list(range(min(CHECK_SEQUENCES, len(sync)))))]
    worst = 0.0
    for tokens in sequences:
        ours = np.asarray(model(hax.named(jnp.asarray(tokens), Pos), attn_mask=AttentionMask.causal()).array)
        theirs = np.asarray(client(jnp.asarray(tokens)[None, :]).logits[0])
        worst = max(worst, float(np.max(np.abs(ours - theirs))))
    eos = tokenizer.eos_token_id
    prompt = [int(t) for t in sequences[0][:CHECK_PROMPT_TOKENS]]
    ours_greedy = greedy_continuation(model, Pos, prompt, CHECK_NEW_TOKENS, eos, len(tokenizer))
    generated = client.generate(jnp.asarray([prompt]), max_new_tokens=CHECK_NEW_TOKENS, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos).sequences[0, len(prompt):].tolist()
    theirs_greedy = generated[:generated.index(eos)] if eos in generated else generated
    check = {"client_check": "transformers FlaxLlamaForCausalLM", "check_set": name,
             "check_sequences": len(sequences), "max_abs_logit_difference": worst,
             "greedy_prompt": prompt, "greedy_tokens": ours_greedy, "greedy_matches": ours_greedy == theirs_greedy}
    if worst > LOGIT_TOLERANCE or ours_greedy != theirs_greedy:
        raise ExportError(f"{out}: transformers reads the export differently from Levanter "
                          f"(max logit difference {worst:.2e}, greedy {ours_greedy} against {theirs_greedy})")
    return check


def main(argv: list[str] | None = None) -> None:
    parser = process_parser(__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the run's Levanter train config YAML")
    parser.add_argument("--checkpoint", help="checkpoint dir (or a parent to search); default: the run's latest")
    parser.add_argument("--output", required=True, help="the directory to write the Hugging Face model to")
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    args = parse_process_args(parser, argv)
    reporter: Reporter
    with exits_when_held("export_main"), input_errors(ExportError, Path(args.output) / EXPORT_ERROR_FILE), \
            open_reporter() as reporter:
        report = export_checkpoint(args.config, args.output, checkpoint_path=args.checkpoint,
                                   max_shard_bytes=args.max_shard_bytes)
        reporter.log(f"exported {report['parameters']:,} parameters to {args.output}")
        reporter.materialization({k: v for k, v in report.items() if not isinstance(v, list)},
                                 asset_key=args.asset_key)


if __name__ == "__main__":
    main()
    # Without the interpreter's teardown of JAX and Levanter, as train_main ends (process_exit.py).
    from marin_resources.process_exit import exit_now

    exit_now(0)
