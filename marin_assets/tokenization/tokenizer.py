"""Tokenizer artifacts: train a byte-level BPE tokenizer or adopt an existing one.

The artifact is a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) so that `transformers.AutoTokenizer.from_pretrained(dir)` and Levanter's
`load_tokenizer` (which wraps AutoTokenizer and accepts fsspec URIs) both load it unchanged.

Only `tokenizers`, `transformers` and `fsspec` are used here; no Levanter/JAX import.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import fsspec

from marin_resources.config_identity import identity
from marin_resources.typed_config import typed_config

TOKENIZER_JSON = "tokenizer.json"
# Levanter builds its cache exemplar from `tokenizer("hi there")`; every field returned there must
# exist in the cache, so the tokenizer must not emit token_type_ids.
MODEL_INPUT_NAMES = ("input_ids", "attention_mask")


@typed_config
@dataclass(frozen=True)
class TokenizerConfig:
    """How to train a byte-level BPE tokenizer.

    `max_train_bytes` caps how much of the text iterator is consumed (a deterministic prefix),
    so that training time stays bounded on large corpora.
    """

    vocab_size: int = identity(32768)
    min_frequency: int = identity(2)
    bos_token: str = identity("<|bos|>")
    eos_token: str = identity("<|eos|>")
    pad_token: str = identity("<|pad|>")
    extra_special_tokens: tuple[str, ...] = identity(())
    # Prepend BOS when callers encode with add_special_tokens=True (the HF default), Llama-style,
    # so prompts encoded at evaluation time start the way training documents do.
    add_bos_on_encode: bool = identity(True)
    max_train_bytes: int | None = identity(None)
    model_max_length: int | None = identity(None)

    def __post_init__(self) -> None:
        specials = self.special_tokens
        if len(set(specials)) != len(specials):
            raise ValueError(f"special tokens must be distinct, got {specials}")
        if any(not s for s in specials):
            raise ValueError("special tokens must be non-empty strings")
        # 256 byte symbols are always in the vocabulary, plus the special tokens.
        if self.vocab_size < 256 + len(specials):
            raise ValueError(f"vocab_size {self.vocab_size} < 256 byte symbols + {len(specials)} special tokens")
        if self.min_frequency < 1:
            raise ValueError("min_frequency must be >= 1")
        if self.max_train_bytes is not None and self.max_train_bytes <= 0:
            raise ValueError("max_train_bytes must be positive when set")

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return (self.bos_token, self.eos_token, self.pad_token, *self.extra_special_tokens)


@dataclass(frozen=True)
class TokenizerArtifact:
    """What a tokenizer directory contains, as recorded right after writing it."""

    path: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    tokenizer_json_sha256: str
    special_tokens: dict[str, str] = field(default_factory=dict)


def _is_remote(path: str) -> bool:
    protocol, _ = fsspec.core.split_protocol(path)
    return protocol not in (None, "file", "local")


@contextlib.contextmanager
def local_tokenizer_dir(tokenizer_dir: str) -> Iterator[str]:
    """Yield a local directory holding the tokenizer files (downloaded when `tokenizer_dir` is remote)."""
    if not _is_remote(tokenizer_dir):
        yield os.path.abspath(os.path.expanduser(fsspec.core.strip_protocol(tokenizer_dir)))
        return
    fs, root = fsspec.core.url_to_fs(tokenizer_dir)
    with tempfile.TemporaryDirectory(prefix="tokenizer-") as tmp:
        for remote in fs.ls(root, detail=False):
            fs.get(remote, os.path.join(tmp, os.path.basename(remote.rstrip("/"))))
        yield tmp


@contextlib.contextmanager
def _writable_dir(out_dir: str) -> Iterator[str]:
    """Yield a local directory to write into; upload it to `out_dir` afterwards when that is remote."""
    if not _is_remote(out_dir):
        local = os.path.abspath(os.path.expanduser(fsspec.core.strip_protocol(out_dir)))
        os.makedirs(local, exist_ok=True)
        yield local
        return
    with tempfile.TemporaryDirectory(prefix="tokenizer-") as tmp:
        yield tmp
        fs, root = fsspec.core.url_to_fs(out_dir)
        fs.makedirs(root, exist_ok=True)
        for name in sorted(os.listdir(tmp)):
            fs.put_file(os.path.join(tmp, name), f"{root.rstrip('/')}/{name}")


def _cap_bytes(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    seen = 0
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"tokenizer training texts must be str, got {type(text).__name__}")
        if max_bytes is not None and seen >= max_bytes:
            return
        seen += len(text.encode("utf-8"))
        yield text


def build_bpe_tokenizer(texts: Iterable[str], cfg: TokenizerConfig):
    """Train and return a `tokenizers.Tokenizer` (byte-level BPE, exact decode(encode(x)) == x)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # No normalizer and no prefix space: every byte of the input survives encoding, so decoding
    # reproduces the document exactly (CRLF, tabs, leading spaces, any Unicode).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(cfg.special_tokens),
        # All 256 byte symbols, so any input is encodable even if unseen in training.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_cap_bytes(texts, cfg.max_train_bytes), trainer=trainer)
    if cfg.add_bos_on_encode:
        tok.post_processor = bos_only_template(cfg.bos_token, tok.token_to_id(cfg.bos_token))
    return tok


def bos_only_template(bos: str, bos_id: int):
    """The post-processor that prepends BOS to an encoded text and appends nothing: a prompt starts
    as a training document did, and does not end as one (EOS would tell a model the text is over)."""
    from tokenizers import processors

    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                         special_tokens=[(bos, bos_id)])


def _save_hf_directory(fast_tokenizer, out_dir: str) -> TokenizerArtifact:
    fast_tokenizer.model_input_names = list(MODEL_INPUT_NAMES)
    fast_tokenizer.init_kwargs["model_input_names"] = list(MODEL_INPUT_NAMES)
    with _writable_dir(out_dir) as local:
        fast_tokenizer.save_pretrained(local)
        with open(os.path.join(local, TOKENIZER_JSON), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    return TokenizerArtifact(
        path=out_dir,
        vocab_size=len(fast_tokenizer),
        bos_token_id=fast_tokenizer.bos_token_id,
        eos_token_id=fast_tokenizer.eos_token_id,
        pad_token_id=fast_tokenizer.pad_token_id,
        tokenizer_json_sha256=digest,
        special_tokens={k: str(v) for k, v in sorted(fast_tokenizer.special_tokens_map.items())},
    )


def train_bpe_tokenizer(texts_iter: Iterable[str], cfg: TokenizerConfig, out_dir: str) -> TokenizerArtifact:
    """Train a byte-level BPE tokenizer on `texts_iter` and save it as a HF tokenizer directory.

    Deterministic: the same texts (in the same order) and config give byte-identical tokenizer.json.
    """
    from transformers import PreTrainedTokenizerFast

    tok = build_bpe_tokenizer(texts_iter, cfg)
    kwargs = {}
    if cfg.model_max_length is not None:
        kwargs["model_max_length"] = cfg.model_max_length
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=cfg.bos_token,
        eos_token=cfg.eos_token,
        pad_token=cfg.pad_token,
        additional_special_tokens=list(cfg.extra_special_tokens) or None,
        # Cleanup would rewrite " ." to "." etc. and break exact decoding.
        clean_up_tokenization_spaces=False,
        model_input_names=list(MODEL_INPUT_NAMES),
        **kwargs,
    )
    return _save_hf_directory(fast, out_dir)


def adopt_tokenizer(source: str, out_dir: str) -> TokenizerArtifact:
    """Copy an existing tokenizer (local directory, fsspec URI, or hub id when online) into `out_dir`.

    Loading through AutoTokenizer and saving again validates that the result loads, and normalises
    the directory to the files AutoTokenizer/Levanter expect.
    """
    from transformers import AutoTokenizer

    looks_like_path = source.startswith(("/", ".", "~")) or "://" in source
    if looks_like_path or os.path.isdir(source):
        if not _is_remote(source) and not os.path.isdir(os.path.expanduser(fsspec.core.strip_protocol(source))):
            raise FileNotFoundError(f"tokenizer directory not found: {source}")
        with local_tokenizer_dir(source) as local:
            tok = AutoTokenizer.from_pretrained(local)
            if not tok.is_fast:
                raise ValueError(f"tokenizer at {source} has no fast (Rust) implementation; it cannot be used")
            return _save_hf_directory(tok, out_dir)
    tok = AutoTokenizer.from_pretrained(source)
    if not tok.is_fast:
        raise ValueError(f"tokenizer {source} has no fast (Rust) implementation; it cannot be used")
    return _save_hf_directory(tok, out_dir)


def tokenizer_json_sha256(tokenizer_dir: str) -> str:
    """sha256 of tokenizer.json: the identity of a tokenizer for cache reuse decisions."""
    with fsspec.open(f"{tokenizer_dir.rstrip('/')}/{TOKENIZER_JSON}", "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
