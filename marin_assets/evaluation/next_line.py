"""An offline multiple-choice task built from held-out text: which line comes next?

Each item is a passage of consecutive lines from one held-out document (for Shakespeare: lines of
one speech) and ``choices`` candidate next lines: the true one and lines drawn from elsewhere in the
same document (or from other held-out documents), or the true one and its own words shuffled
(``distractors: shuffled_words``). The task is symmetric: every distractor is the
true continuation of some other passage (the third or a later line of its own), so position in a
speech gives nothing away; and distractors have about the answer's length, so that the summed
log-likelihood (lm-eval's ``acc``) is not won by the shortest line. Nothing is templated: every
string is a line of the source, or (shuffled words) one with its words reordered by this code.

Deterministic: the same documents, spec and seed give the same items in the same order (the order
is shuffled once, so an lm-eval ``limit`` takes a sample spread over every document).

Pure Python; no Dagster, lm-eval or JAX import.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import yaml

from marin_resources.config_identity import config_identity, identity

DATA_FILE_SUFFIX = ".jsonl"
TASK_FILE_SUFFIX = ".yaml"
LENGTH_RATIO = 1.25
"""A distractor's length is within this factor of the answer's (both ways)."""


class TaskSpecError(ValueError):
    pass


DistractorSource = Literal["same_document", "other_documents", "shuffled_words"]
DISTRACTOR_SOURCES = get_args(DistractorSource)
Continuation = Literal["next_line", "line_end"]
CONTINUATIONS = get_args(Continuation)
MIN_WORDS_TO_SPLIT = 4
MIN_WORDS_TO_SHUFFLE = 4
"""A line of fewer words has too few orders to draw distinct shuffles from."""
SHUFFLE_TRIES = 20


@dataclass(frozen=True)
class NextLineTaskSpec:
    """How a next-line task is built from the held-out split of ``tokenized/<source>``."""

    name: str = identity()
    source: str = identity()
    """A tokenized source; its validation documents (never trained on) are the task's text."""
    choices: int = identity(4)
    context_lines: int = identity(4)
    """At most this many lines of the passage precede the answer (at least two)."""
    min_chars: int = identity(20)
    """Answers and distractors are lines of at least this many characters."""
    examples: int = identity(1000)
    """Items kept (after a seeded shuffle); fewer when the held-out text has fewer positions."""
    seed: int = identity(0)
    distractors: DistractorSource = identity("same_document")
    continuation: Continuation = identity("next_line")
    """What is chosen: the whole next line, or the second half of the line (its first half ends the
    context), which a small model can judge from the words at the cut."""
    """Where wrong choices come from: other passages of the answer's document (the harder task: same
    names, same topic), other held-out documents, or the answer's own words in another order
    (``shuffled_words``: the same words and length, so only word order tells them apart, a signal a
    model of a few million parameters already has)."""

    def __post_init__(self) -> None:
        def require(ok: bool, problem: str) -> None:
            if not ok:
                raise TaskSpecError(f"offline task {self.name!r}: {problem}")

        require(bool(self.name) and self.name.replace("_", "").isalnum(), "name must be letters, digits and _")
        require(bool(self.source), "source must name a tokenized source")
        require(self.choices >= 2, f"choices must be at least 2, got {self.choices}")
        require(self.context_lines >= 2, f"context_lines must be at least 2, got {self.context_lines}")
        require(self.min_chars >= 1, f"min_chars must be positive, got {self.min_chars}")
        require(self.examples >= 1, f"examples must be positive, got {self.examples}")
        require(self.distractors in DISTRACTOR_SOURCES, f"distractors must be one of {list(DISTRACTOR_SOURCES)}")
        require(self.continuation in CONTINUATIONS, f"continuation must be one of {list(CONTINUATIONS)}")

    @property
    def chance(self) -> float:
        return 1.0 / self.choices

    def identity(self) -> dict[str, Any]:
        return config_identity(self)


@dataclass(frozen=True)
class NextLineItem:
    doc_id: str
    context: str
    choices: tuple[str, ...]
    label: int

    def to_json(self) -> dict[str, Any]:
        return {"doc_id": self.doc_id, "context": self.context, "choices": list(self.choices), "label": self.label}


def _paragraphs(text: str) -> list[list[str]]:
    """Blank-line separated blocks of stripped, non-empty lines."""
    blocks, current = [], []
    for raw in text.replace("\r\n", "\n").split("\n"):
        line = raw.strip()
        if line:
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    return blocks


def _stable_seed(*parts: Any) -> int:
    return int(hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16], 16)


Pool = list[tuple[str, tuple[str, int]]]
"""Candidate distractors: (line, (document id, paragraph index)), sorted by length."""


def split_line(line: str, continuation: str) -> tuple[str, str] | None:
    """(what the context ends with, what is to be chosen); None if the line cannot be cut."""
    if continuation == "next_line":
        return "", line
    words = line.split(" ")
    if len(words) < MIN_WORDS_TO_SPLIT:
        return None
    half = len(words) // 2
    return " ".join(words[:half]), " ".join(words[half:])


def line_pool(documents: Iterable[tuple[str, str]], spec: NextLineTaskSpec) -> Pool:
    """Every line that is itself an answer somewhere: the third or a later line of its passage. A
    distractor is then the true continuation of another passage, never a line a model could tell
    apart by where it sits (a speaker's name, the first line of a speech)."""
    pool = [(cut[1], (doc_id, p)) for doc_id, text in documents for p, block in enumerate(_paragraphs(text))
            for line in block[2:] if len(line) >= spec.min_chars
            and (cut := split_line(line, spec.continuation)) is not None]
    pool.sort(key=lambda entry: (len(entry[0]), entry))
    return pool


def _draw_distractors(pool: Pool, lo: int, hi: int, eligible, k: int, rng: random.Random) -> list[str] | None:
    """``k`` distinct eligible lines of ``pool[lo:hi]``; None if there are fewer. Rejection
    sampling keeps a long play linear; a sparse window falls back to listing it."""
    picked: list[str] = []
    if hi - lo >= 4 * k:
        for _ in range(8 * k):
            line, where = pool[rng.randrange(lo, hi)]
            if eligible(line, where) and line not in picked:
                picked.append(line)
                if len(picked) == k:
                    return picked
    candidates = sorted({line for line, where in pool[lo:hi] if eligible(line, where)})
    return rng.sample(candidates, k) if len(candidates) >= k else None


def shuffled_words(line: str, k: int, rng: random.Random) -> list[str] | None:
    """``k`` distinct orders of the words of ``line``, none of them ``line`` itself; None when the
    line has too few words (or too few distinct orders of them, e.g. a repeated word)."""
    words = line.split(" ")
    if len(words) < MIN_WORDS_TO_SHUFFLE:
        return None
    picked: list[str] = []
    for _ in range(SHUFFLE_TRIES * k):
        order = words[:]
        rng.shuffle(order)
        candidate = " ".join(order)
        if candidate != line and candidate not in picked:
            picked.append(candidate)
            if len(picked) == k:
                return picked
    return None


def document_items(doc_id: str, text: str, spec: NextLineTaskSpec, pool: Pool | None = None) -> list[NextLineItem]:
    """Every item one document yields (before the corpus-wide shuffle and cut). ``pool``: the
    corpus's lines, needed when distractors come from other documents."""
    if spec.distractors == "same_document":
        pool = line_pool([(doc_id, text)], spec)
    elif spec.distractors == "shuffled_words":
        pool = []  # each answer's distractors are its own words
    elif pool is None:
        raise ValueError("distractors from other documents need the corpus's line pool")
    lengths = [len(line) for line, _ in pool]
    rng = random.Random(_stable_seed(spec.seed, doc_id))
    items = []
    for p, block in enumerate(_paragraphs(text)):
        lines = {cut[1] for line in block if (cut := split_line(line, spec.continuation)) is not None}

        # Never a line of the passage itself (it could be a true continuation too); from the same
        # document, only other passages; from other documents, any.
        def eligible(line: str, where: tuple[str, int]) -> bool:
            if spec.distractors == "same_document":
                return where != (doc_id, p) and line not in lines  # noqa: B023 - called within this iteration
            return where[0] != doc_id and line not in lines  # noqa: B023 - called within this iteration

        for j in range(2, len(block)):
            cut = split_line(block[j], spec.continuation)
            if len(block[j]) < spec.min_chars or cut is None:
                continue
            head, answer = cut
            if spec.distractors == "shuffled_words":
                choices = shuffled_words(answer, spec.choices - 1, rng)
            else:
                low, high = len(answer) / LENGTH_RATIO, len(answer) * LENGTH_RATIO
                choices = _draw_distractors(pool, bisect.bisect_left(lengths, low),
                                            bisect.bisect_right(lengths, high), eligible, spec.choices - 1, rng)
            if choices is None:
                continue
            label = rng.randrange(spec.choices)
            choices.insert(label, answer)
            context = "\n".join(block[max(0, j - spec.context_lines):j] + ([head] if head else []))
            items.append(NextLineItem(doc_id, context, tuple(choices), label))
    return items


def build_items(documents: Iterable[tuple[str, str]], spec: NextLineTaskSpec) -> list[NextLineItem]:
    """Items over all documents (taken in id order), shuffled with ``spec.seed``, cut to ``spec.examples``."""
    documents = sorted(documents)
    pool = line_pool(documents, spec) if spec.distractors == "other_documents" else None
    items = [item for doc_id, text in documents for item in document_items(doc_id, text, spec, pool)]
    random.Random(spec.seed).shuffle(items)
    return items[: spec.examples]


def write_items(items: Sequence[NextLineItem]) -> str:
    return "".join(json.dumps(item.to_json(), ensure_ascii=False, sort_keys=True) + "\n" for item in items)


def render_task_yaml(spec: NextLineTaskSpec, data_file: str) -> str:
    """The lm-eval task config over a local JSON-lines file (HF ``datasets``' packaged json loader:
    no hub access). The continuation follows the passage on a new line, as in the text."""
    config = {
        "task": spec.name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": data_file}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "\n" if spec.continuation == "next_line" else " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0, "built_by": "marin_assets.evaluation.next_line", "spec": spec.identity()},
    }
    return yaml.safe_dump(config, sort_keys=False)


def task_data_files(task_yaml_text: str) -> list[str]:
    """The local data files an lm-eval task config reads (``dataset_kwargs.data_files``)."""
    config = yaml.safe_load(task_yaml_text) or {}
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
    return list(files)
