"""The weights a run starts from (`RunSpec.init_from`): where they are, what they are, whether they fit.

A source is a Hugging Face model directory: ``config.json`` and safetensors weights (one
``model.safetensors``, or ``model.safetensors.index.json`` and the shards it lists). It is another
run's ``hf_model`` export, a local or bucket directory read through fsspec as the store is, or a
Hub repository ``hf://ORG/NAME[@REVISION]`` read through huggingface_hub's client.

Two sides, both without Dagster, JAX or Levanter:

- the checkpoint asset *resolves* the source (`resolve_path`, `resolve_export`) to `InitWeights`:
  a URI pinned to exactly these bytes (a Hub revision becomes its commit) and the content hash of
  the files, which enters the run's identity (`RunSpec.identity`);
- the training process *stages* them (`stage_weights`: copies a remote source to local scratch,
  hashing as it reads, and refuses bytes other than the resolved ones) and *checks* them against
  the run (`check_weights`: architecture, shape, vocabulary, intact safetensors) before Levanter
  loads them with its own Hugging Face converter.

Every refusal is an `InitWeightsError`: one line naming the path and the missing or mismatched piece.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marin_assets.training.spec import HF_MODEL_PATH_RE
from marin_resources.typed_config import ConfigError

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
HF_SCHEME = "hf"
# What has to agree between the weights' config.json and the run's model (as transformers names it):
# Levanter loads the tensors into the run's model and would otherwise read them with other settings.
ARCHITECTURE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "tie_word_embeddings", "rms_norm_eps", "rope_theta",
                     "rope_scaling")
REQUIRED_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


class InitWeightsError(ConfigError):
    """The weights a run starts from are missing, damaged or do not fit the run; the message names
    the path and the piece."""


@dataclass(frozen=True)
class InitWeights:
    """A resolved source: ``uri`` reads exactly these ``files`` (name -> sha256)."""

    uri: str
    """A local directory, an fsspec URL, or ``hf://ORG/NAME@<commit>``."""
    files: tuple[tuple[str, str], ...]

    @property
    def sha256(self) -> str:
        """The content hash of the weights: `weights_digest` of ``files``."""
        return weights_digest(dict(self.files))


def weights_digest(files: Mapping[str, str]) -> str:
    """sha256 of the lines ``<name> <sha256 of the file>``, sorted by name: the same files give the
    same hash wherever they are (a run's export, a bucket, the Hub)."""
    text = "".join(f"{name} {digest}\n" for name, digest in sorted(files.items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def model_files(fs, root: str, where: str) -> list[str]:
    """``config.json`` and the weight files of the model directory ``root`` on ``fs``: the index and
    the shards it lists, or ``model.safetensors``. ``where`` names the directory in messages."""
    if not fs.exists(f"{root}/{CONFIG_FILE}"):
        raise InitWeightsError(f"{where}: no {CONFIG_FILE}; a Hugging Face model directory has one")
    if fs.exists(f"{root}/{SAFETENSORS_INDEX}"):
        try:
            shards = sorted(set(json.loads(fs.cat_file(f"{root}/{SAFETENSORS_INDEX}"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InitWeightsError(f"{where}/{SAFETENSORS_INDEX}: not a safetensors index (no weight_map of "
                                   "tensor names to files)") from None
        for shard in shards:
            if not isinstance(shard, str) or "/" in shard or shard in ("", ".", ".."):
                raise InitWeightsError(f"{where}/{SAFETENSORS_INDEX}: lists {shard!r}, not a file of the directory")
            if not fs.exists(f"{root}/{shard}"):
                raise InitWeightsError(f"{where}/{shard}: listed in {SAFETENSORS_INDEX} but not there")
        return [CONFIG_FILE, SAFETENSORS_INDEX, *shards]
    if fs.exists(f"{root}/{SAFETENSORS_FILE}"):
        return [CONFIG_FILE, SAFETENSORS_FILE]
    raise InitWeightsError(f"{where}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (weights are read as "
                           "safetensors only)")


# ---- resolving (the checkpoint asset) -------------------------------------------------------------


def resolve_path(path: str, hashes) -> InitWeights:
    """``init_from.path`` pinned and hashed. ``hashes`` is a `ContentHashCache`: a local file is hashed
    again only when its stat changes, a bucket object when its size or modification time does, a Hub
    file never (it is pinned to a commit; an LFS file's sha256 comes from the Hub's listing)."""
    import fsspec

    if path.startswith(f"{HF_SCHEME}://"):
        return _resolve_hub(path, hashes)
    fs, root = fsspec.core.url_to_fs(path)
    root = root.rstrip("/") or "/"
    if not fs.isdir(root):
        raise InitWeightsError(f"{path}: no such directory")
    local = "file" in _protocols(fs)
    files = {}
    for name in model_files(fs, root, path):
        full = f"{root}/{name}"
        files[name] = hashes.sha256(full) if local else \
            hashes.sha256_of_listed(fs, full, fs.unstrip_protocol(full), fs.info(full))
    return InitWeights(uri=root if local else fs.unstrip_protocol(root), files=tuple(sorted(files.items())))


def _protocols(fs) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _resolve_hub(path: str, hashes) -> InitWeights:
    """``hf://ORG/NAME[@REVISION]``: the revision (default main) resolved to its commit, as the
    curation stage's Hub source does; the URI names the commit, so later reads get the same bytes."""
    from marin_assets.curation.schemes.hf import hub_commit, use_hf_endpoint

    match = HF_MODEL_PATH_RE.match(path)
    if match is None:
        raise InitWeightsError(f"{path}: expected hf://ORG/NAME[@REVISION]")
    repo = match["repo"]
    use_hf_endpoint()
    try:
        fs, commit = hub_commit(repo, "model", match["rev"] or "main", path)
    except FileNotFoundError as exc:
        raise InitWeightsError(str(exc)) from None
    root = f"{repo}@{commit}"
    files = {}
    for name in model_files(fs, root, path):
        info = fs.info(f"{root}/{name}")
        lfs = info.get("lfs") or {}
        # The Hub keeps an LFS file's sha256; a small file is hashed once, keyed by its pinned URI.
        files[name] = lfs.get("sha256") or hashes.sha256_of_remote(
            fs, f"{root}/{name}", f"{HF_SCHEME}://{root}/{name}", info.get("size"), commit)
    return InitWeights(uri=f"{HF_SCHEME}://{root}", files=tuple(sorted(files.items())))


def resolve_export(uri: str, manifest_files: Mapping[str, str], where: str) -> InitWeights:
    """Another run's ``hf_model`` artifact at ``uri`` (an fsspec path the training process reads),
    hashed by its manifest: the sha256 of each file, recorded when it was committed."""
    if CONFIG_FILE not in manifest_files:
        raise InitWeightsError(f"{where}: no {CONFIG_FILE}; a Hugging Face model directory has one")
    names = [n for n in manifest_files if n == CONFIG_FILE or n == SAFETENSORS_INDEX or n.endswith(".safetensors")]
    if not any(n.endswith(".safetensors") for n in names):
        raise InitWeightsError(f"{where}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}")
    return InitWeights(uri=uri, files=tuple(sorted((n, manifest_files[n]) for n in names)))


# ---- Levanter's name for a source -------------------------------------------------------------------


def levanter_reference(uri: str) -> str:
    """The source as Levanter's ``initialize_from_hf`` reads it: a Hub model as ``ORG/NAME@REVISION``
    (its own syntax), a directory or URL as it is."""
    prefix = f"{HF_SCHEME}://"
    return uri[len(prefix):] if uri.startswith(prefix) else uri


def uri_of_reference(reference: str) -> str:
    """The inverse of `levanter_reference`: a reference that is neither a URL nor an absolute path
    names a Hub repository."""
    return reference if "://" in reference or os.path.isabs(reference) else f"{HF_SCHEME}://{reference}"


# ---- staging and checking (the training process) --------------------------------------------------


@contextlib.contextmanager
def hub_reads() -> Iterator[None]:
    """Reads from the Hub while this block runs. Training processes run with ``HF_HUB_OFFLINE=1`` so
    that nothing fetches from the Hub unasked; a run that names Hub weights asks for these files."""
    from huggingface_hub import constants
    from huggingface_hub.utils import reset_sessions

    from marin_assets.curation.schemes.hf import use_hf_endpoint

    offline = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = False
    reset_sessions()
    use_hf_endpoint()
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = offline
        reset_sessions()


def stage_weights(uri: str, expected_sha256: str | None, scratch: str | os.PathLike) -> str:
    """A local directory holding the model files of ``uri``: the directory itself when it is local,
    else a copy in ``scratch``. Every file is read once and hashed; with ``expected_sha256`` (what the
    asset resolved) other bytes are refused, so the run trains from the weights its identity names."""
    import fsspec

    with hub_reads() if uri.startswith(f"{HF_SCHEME}://") else contextlib.nullcontext():
        fs, root = fsspec.core.url_to_fs(uri)
        root = root.rstrip("/") or "/"
        local = "file" in _protocols(fs)
        target = Path(root if local else scratch)
        target.mkdir(parents=True, exist_ok=True)
        files = {}
        for name in model_files(fs, root, uri):
            digest = hashlib.sha256()
            with fs.open(f"{root}/{name}", "rb") as src, \
                    (contextlib.nullcontext() if local else open(target / name, "wb")) as dst:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    if dst is not None:
                        dst.write(chunk)
            files[name] = digest.hexdigest()
    found = weights_digest(files)
    if expected_sha256 is not None and found != expected_sha256:
        raise InitWeightsError(f"{uri}: the weights changed since the run was resolved (content sha256 {found[:12]}, "
                               f"the run's identity names {expected_sha256[:12]}); materialize the run again")
    if not local:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if fs.exists(f"{root}/{name}"):  # compared with the run's tokenizer by `check_weights`
                fs.get_file(f"{root}/{name}", str(target / name))
    return str(target)


def check_safetensors(path: Path, where: str) -> dict[str, list[int]]:
    """The file holds every byte its header promises (a truncated download or copy does not); returns
    the shape of each tensor its header lists."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > size - 8:
            raise InitWeightsError(f"{where}: truncated: {size:,} bytes, not even the safetensors header")
        try:
            header = json.loads(fh.read(length))
            tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
            end = max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
            shapes = {name: [int(n) for n in entry["shape"]] for name, entry in tensors.items()}
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise InitWeightsError(f"{where}: not a safetensors file (its header is not a tensor table)") from None
    if size < 8 + length + end:
        raise InitWeightsError(f"{where}: truncated: {size:,} bytes of the {8 + length + end:,} its header lists")
    return shapes


def expected_tensor_shapes(config: Mapping[str, Any]) -> dict[str, list[int]]:
    """The shape of each tensor a Hugging Face checkpoint of ``config`` (a config.json of one of the
    families `check_weights` accepts) holds, by its PyTorch name: what Levanter's converter will reshape
    into the run's model. Tensors a family adds that are not listed here are left to the converter."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config.get("num_attention_heads") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inner = config.get("intermediate_size")
    family = config["model_type"]
    shapes = {"model.embed_tokens.weight": [config["vocab_size"], hidden], "model.norm.weight": [hidden]}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = [config["vocab_size"], hidden]
    for i in range(layers):
        layer = f"model.layers.{i}"
        shapes.update({f"{layer}.self_attn.q_proj.weight": [heads * head_dim, hidden],
                       f"{layer}.self_attn.k_proj.weight": [kv_heads * head_dim, hidden],
                       f"{layer}.self_attn.v_proj.weight": [kv_heads * head_dim, hidden],
                       f"{layer}.self_attn.o_proj.weight": [hidden, heads * head_dim],
                       f"{layer}.post_attention_layernorm.weight": [hidden]})
        if family != "olmo2":  # OLMo 2 normalises after attention and MLP only
            shapes[f"{layer}.input_layernorm.weight"] = [hidden]
        if family == "mixtral":
            shapes[f"{layer}.block_sparse_moe.gate.weight"] = [config["num_local_experts"], hidden]
            for e in range(config["num_local_experts"]):
                expert = f"{layer}.block_sparse_moe.experts.{e}"
                shapes.update({f"{expert}.w1.weight": [inner, hidden], f"{expert}.w3.weight": [inner, hidden],
                               f"{expert}.w2.weight": [hidden, inner]})
        elif inner is not None:
            shapes.update({f"{layer}.mlp.gate_proj.weight": [inner, hidden],
                           f"{layer}.mlp.up_proj.weight": [inner, hidden],
                           f"{layer}.mlp.down_proj.weight": [hidden, inner]})
    return shapes


def check_weights(directory: str, expected: Mapping[str, Any], tokenizer) -> dict:
    """Refuse weights that do not fit the run, before training: ``expected`` is the run's model as a
    transformers config dict (``model_type`` and shape), ``tokenizer`` the run's tokenizer. The
    vocabulary fits when the directory's own tokenizer maps every token to the same id as the run's
    (extra rows past it, padding, are dropped by Levanter's loader), or, without a tokenizer there,
    when ``vocab_size`` is the run tokenizer's length. Returns the weights' config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = Path(directory)
    where = f"{directory}/{CONFIG_FILE}"
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except ValueError:
        raise InitWeightsError(f"{where}: not JSON") from None
    if not isinstance(config, dict):
        raise InitWeightsError(f"{where}: not a model config (a JSON object)")
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise InitWeightsError(f"{where}: no {', '.join(missing)}")
    wanted_type = expected["model_type"]
    wanted_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(wanted_type, wanted_type)
    architectures = config.get("architectures") or []
    if config["model_type"] != wanted_type or any(a != wanted_class for a in architectures):
        raise InitWeightsError(f"{where}: architecture {'/'.join(architectures) or '?'} (model_type "
                               f"{config['model_type']!r}) is not supported here: this run trains {wanted_class} "
                               f"(model_type {wanted_type!r})")
    for key in ARCHITECTURE_KEYS:
        if key in config and key in expected and config[key] != expected[key]:
            raise InitWeightsError(f"{where}: {key} is {config[key]!r}, the run's model has {expected[key]!r}")
    has_tokenizer = (root / "tokenizer.json").exists()
    if has_tokenizer:
        check_same_vocabulary(root, tokenizer)
    if config["vocab_size"] < len(tokenizer) or (config["vocab_size"] != len(tokenizer) and not has_tokenizer):
        raise InitWeightsError(f"{where}: vocab_size {config['vocab_size']} does not match the run's tokenizer "
                               f"({len(tokenizer)} entries)")
    import fsspec

    expected_shapes = expected_tensor_shapes(config)
    for name in model_files(fsspec.filesystem("file"), str(root), directory):
        if name.endswith(".safetensors"):
            for tensor, shape in check_safetensors(root / name, f"{directory}/{name}").items():
                wanted = expected_shapes.get(tensor)
                if wanted is not None and shape != wanted:
                    raise InitWeightsError(f"{directory}/{name}: {tensor} has shape {shape}; config.json and the "
                                           f"run's model make it {wanted}")
    return config


def check_same_vocabulary(root: Path, tokenizer) -> None:
    """The directory's own tokenizer maps every token to the id the run's tokenizer does: a model
    trained with another vocabulary of the same size would read every token as another."""
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json")).get_vocab()
    ours = tokenizer.get_vocab()
    if theirs != ours:
        token = next(t for t in sorted(set(ours) | set(theirs)) if ours.get(t) != theirs.get(t))
        raise InitWeightsError(f"{root}/tokenizer.json: its vocabulary differs from the run's tokenizer "
                               f"({len(theirs)} entries against {len(ours)}; token {token!r} is "
                               f"{theirs.get(token)} there, {ours.get(token)} here)")

