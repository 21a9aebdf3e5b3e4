"""Our heuristic rules and rule families against DataTrove's filters (Gopher, C4, FineWeb, Gopher repetition), on the
same documents.

DataTrove is installed into a throwaway virtual environment created here (`uv venv` in a
temporary folder, then `uv pip install "datatrove[processing]" spacy`; spaCy is its English word
tokenizer), never into the project, and runs there as a subprocess that reads the same JSONL
and reports timings and per-document decisions as JSON.

Documents (real text, all of it on this machine): the Shakespeare plays and installed-package
READMEs and licences of `benchmarks/filters.py` cut into ~2 KB pieces, and web pages: the real
HTML documentation found by `web.reference_pages()` through our extractor (`web.html_to_text`).

Speed is CPU seconds per filter pass (best of `--repeats`), one thread each (polars pinned to one
thread), as documents per second per core:

* ours (Gopher rules): `apply_filters` with the rules that have a Gopher counterpart
  (language id and the duplicate line/paragraph rules off, as GopherQualityFilter has neither);
* ours (all rules, no language id): adds the duplicate rules;
* DataTrove GopherQualityFilter, C4QualityFilter, and both one after the other.

Agreement, per Gopher rule: each rule decided alone by each side (DataTrove's filter with only
that rule's threshold set; its word lists are memoised for these passes only, after the timing),
as the share of documents on which the two decisions are equal, with the counts of the two kinds
of disagreement; and once more with DataTrove given whitespace-separated words instead of spaCy
tokens, which separates what the tokenizer decides from what the rule decides. C4QualityFilter's
rules (terminal punctuation, lines of 3+ words, 5+ sentences, curly brackets, lorem ipsum,
javascript/policy lines) are reported by reason, and against our overall decision.

The families (`rules.py`): each of c4, fineweb and gopher_repetition alone (no language id, no
Gopher rule) against DataTrove's C4QualityFilter, FineWebQualityFilter and GopherRepetitionFilter
(only its n-gram rules, the part the family has), CPU seconds and MB/s per core of each. Then per
rule, each decided alone on both sides (DataTrove's filter with only the counterpart of that rule
on), and for c4's line rules the documents from which both remove the same number of lines
(DataTrove's line counters per document), plus the share of documents whose text c4 leaves the
same on both sides; the rules that count words once more with DataTrove on whitespace words.

    python -m benchmarks.curation_peer [--docs 3000] [--pages 300] [--repeats 2] [--venv DIR]

`--venv` reuses an existing environment that already has datatrove (skips the install). The last
line printed is a JSON summary.
"""

from __future__ import annotations

import os

os.environ["POLARS_MAX_THREADS"] = "1"  # per-core figures; before polars is imported

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import polars as pl

from marin_assets.curation.filters import RULE_ORDER, FilterConfig, apply_filters, enabled_rules
from marin_assets.curation.rules import OPTIONAL_FAMILIES, RULES, c4_statistics

DATATROVE = "datatrove[processing]==0.10.1"

# Our rule -> the DataTrove GopherQualityFilter arguments that decide the same thing alone.
GOPHER_RULES: dict[str, dict[str, object]] = {
    "min_words": {"min_doc_words": 50},
    "max_words": {"max_doc_words": 100_000},
    "min_mean_word_length": {"min_avg_word_length": 3},
    "max_mean_word_length": {"max_avg_word_length": 10},
    "max_symbol_word_ratio": {"max_symbol_word_ratio": 0.1},
    "max_non_alpha_word_fraction": {"max_non_alpha_words_ratio": 0.8},
    "max_bullet_line_fraction": {"max_bullet_lines_ratio": 0.9},
    "max_ellipsis_line_fraction": {"max_ellipsis_lines_ratio": 0.3},
    "min_stop_words": {"min_stop_words": 2},
}
GOPHER_OFF = {"min_doc_words": None, "max_doc_words": None, "min_avg_word_length": None, "max_avg_word_length": None,
              "max_symbol_word_ratio": None, "max_bullet_lines_ratio": None, "max_ellipsis_lines_ratio": None,
              "max_non_alpha_words_ratio": None, "min_stop_words": None}

# Runs inside the throwaway environment: argv = documents.jsonl, rules.json, repeats.
WORKER = textwrap.dedent('''
    import json, sys, time
    from datatrove.data import Document
    from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter
    import datatrove.pipeline.filters.gopher_quality_filter as gopher_module

    texts = [json.loads(line)["text"] for line in open(sys.argv[1])]
    rules, off = json.load(open(sys.argv[2]))
    repeats = int(sys.argv[3])

    def decide(filt, text):
        result = filt.filter(Document(text=text, id="x"))
        return "kept" if result is True else (result[1] if isinstance(result, tuple) else "dropped")

    def timed(filters):
        for filt in filters:  # load the tokenizer outside the timing
            decide(filt, texts[0])
        best, decisions = float("inf"), None
        for _ in range(repeats):
            start = time.process_time()
            decisions = [[decide(f, t) for f in filters] for t in texts]
            best = min(best, time.process_time() - start)
        return best, decisions

    out = {}
    out["gopher_cpu_s"], gopher = timed([GopherQualityFilter()])
    out["c4_cpu_s"], c4 = timed([C4QualityFilter()])
    out["gopher"] = [d[0] for d in gopher]
    out["c4"] = [d[0] for d in c4]
    # Per-rule passes: memoise the tokenizer (the timing above is done).
    words = {}
    split = gopher_module.split_into_words
    gopher_module.split_into_words = \
        lambda text, language: words.get(text) or words.setdefault(text, split(text, language))
    out["rules"] = {}
    for rule, args in rules.items():
        filt = GopherQualityFilter(**{**off, **args})
        out["rules"][rule] = [decide(filt, t) != "kept" for t in texts]
    # The same rules on whitespace-separated words instead of spaCy tokens: what is left of a
    # disagreement then is the rule, not the tokenizer.
    gopher_module.split_into_words = lambda text, language: text.split()
    out["rules_whitespace"] = {}
    for rule, args in rules.items():
        filt = GopherQualityFilter(**{**off, **args})
        out["rules_whitespace"][rule] = [decide(filt, t) != "kept" for t in texts]

    # The families: each of DataTrove's filters timed with its defaults (Gopher repetition with only
    # its n-gram rules, the part our gopher_repetition family has), then each rule decided alone.
    from datatrove.pipeline.filters import FineWebQualityFilter, GopherRepetitionFilter
    import datatrove.pipeline.filters.c4_filters as c4_module
    import datatrove.pipeline.filters.fineweb_quality_filter as fineweb_module
    import datatrove.pipeline.filters.gopher_repetition_filter as repetition_module

    no_lines = dict(dup_line_frac=None, dup_para_frac=None, dup_line_char_frac=None, dup_para_char_frac=None)
    out["family_cpu_s"] = {}
    out["family_cpu_s"]["c4"], _ = timed([C4QualityFilter()])
    out["family_cpu_s"]["fineweb"], _ = timed([FineWebQualityFilter()])
    out["family_cpu_s"]["gopher_repetition"], _ = timed([GopherRepetitionFilter(**no_lines)])
    for module in (c4_module, fineweb_module, repetition_module):  # memoised for the per-rule passes
        for name in ("split_into_words", "split_into_sentences"):
            if hasattr(module, name):
                cache, real = {}, getattr(module, name)
                setattr(module, name, lambda text, language, cache=cache, real=real:
                        cache[text] if text in cache else cache.setdefault(text, real(text, language)))

    def reasons(filt):
        return [decide(filt, t) for t in texts]

    family = {}
    # C4: a document rule alone is C4 with the other two document rules off (its line rules on).
    family["c4.min_sentences"] = reasons(C4QualityFilter(filter_lorem_ipsum=False, filter_curly_bracket=False))
    family["c4.max_lorem_ipsum_lines"] = reasons(C4QualityFilter(min_num_sentences=-1, filter_curly_bracket=False))
    family["c4.max_curly_bracket_lines"] = reasons(C4QualityFilter(min_num_sentences=-1, filter_lorem_ipsum=False))
    # Its line rules: the lines each removed from each document (no document rule, so no early return).
    lines = C4QualityFilter(min_num_sentences=-1, filter_lorem_ipsum=False, filter_curly_bracket=False)
    removed = []
    def count(*labels, **kwargs):
        for label in labels:
            removed[-1][label] = removed[-1].get(label, 0) + 1
    lines.stat_update = count
    c4_texts = []
    for t in texts:
        removed.append({})
        doc = Document(text=t, id="x")
        c4_texts.append(doc.text if lines.filter(doc) is True else None)
    out["c4_line_removals"] = removed
    out["c4_texts"] = c4_texts
    off = dict(line_punct_thr=-1.0, short_line_thr=1e9, char_duplicates_ratio=1e9, new_line_ratio=1e9)
    for rule, args in {"fineweb.min_line_punct_ratio": {"line_punct_thr": 0.12},
                       "fineweb.max_short_line_ratio": {"short_line_thr": 0.67},
                       "fineweb.max_char_duplicate_ratio": {"char_duplicates_ratio": 0.01},
                       "fineweb.max_newline_ratio": {"new_line_ratio": 0.3}}.items():
        family[rule] = reasons(FineWebQualityFilter(**{**off, **args}))
    tops, dups = dict(((2, 0.2), (3, 0.18), (4, 0.16))), dict(((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12),
                                                              (9, 0.11), (10, 0.10)))

    def repetition_rules():
        decided = {}
        for n, frac in tops.items():
            filt = GopherRepetitionFilter(**no_lines, top_n_grams=((n, frac),), dup_n_grams=())
            decided[f"gopher_repetition.max_top_{n}gram_fraction"] = reasons(filt)
        for n, frac in dups.items():
            filt = GopherRepetitionFilter(**no_lines, top_n_grams=(), dup_n_grams=((n, frac),))
            decided[f"gopher_repetition.max_duplicate_{n}gram_fraction"] = reasons(filt)
        return decided

    family.update(repetition_rules())
    out["family_rules"] = family
    # Once more with whitespace words instead of spaCy tokens, where words are what a rule counts.
    whitespace = lambda text, language: text.split()
    repetition_module.split_into_words = whitespace
    fineweb_module.split_into_words = whitespace
    out["family_rules_whitespace"] = {**repetition_rules(), "fineweb.max_newline_ratio":
                                      reasons(FineWebQualityFilter(**{**off, "new_line_ratio": 0.3}))}
    print(json.dumps(out))
''')


def make_environment(folder: Path) -> Path:
    """A fresh virtual environment with DataTrove, under ``folder``; its python."""
    subprocess.run(["uv", "venv", "-q", "--python", f"{sys.version_info.major}.{sys.version_info.minor}",
                    str(folder)], check=True)
    python = folder / "bin" / "python"
    subprocess.run(["uv", "pip", "install", "-q", "--python", str(python), DATATROVE, "spacy"], check=True)
    return python


def load_corpus(n_docs: int, n_pages: int) -> pl.DataFrame:
    from benchmarks.filters import chunk_documents, load_documents
    from marin_assets.curation.web import html_to_text, reference_pages

    pieces = chunk_documents(load_documents())
    pieces = pieces.sample(n=min(n_docs, pieces.height), seed=0, shuffle=True) if pieces.height > n_docs else pieces
    pages = []
    for path in reference_pages(limit=4 * n_pages):
        text, _ = html_to_text(path.read_text("utf-8", errors="replace"))
        if text.strip():
            pages.append(text.strip())
        if len(pages) == n_pages:
            break
    texts = pieces["text"].to_list() + pages
    kinds = ["text"] * pieces.height + ["web"] * len(pages)
    return pl.DataFrame({"id": [str(i) for i in range(len(texts))], "text": texts, "kind": kinds})


def our_pass(docs: pl.DataFrame, cfg: FilterConfig, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.process_time()
        result = apply_filters(docs, cfg)
        best = min(best, time.process_time() - start)
    return best, result


def our_rule_failures(docs: pl.DataFrame, result) -> dict[str, list[bool]]:
    failed = dict(zip(result.dropped["id"].to_list(), result.dropped["failed_rules"].to_list()))
    return {rule: [rule in failed.get(i, ()) for i in docs["id"].to_list()] for rule in GOPHER_RULES}


# DataTrove's C4 line counters -> our c4 line rules.
C4_LINE_RULES = {"line-filter-too_long_word": "c4.max_line_word_length",
                 "line-filter-no_terminal_punc": "c4.min_line_terminal_punctuation",
                 "line-filter-too_few_words": "c4.min_line_words", "line-filter-javascript": "c4.max_line_javascript",
                 "line-filter-policy": "c4.max_line_policy_phrases"}


def family_config(family: str) -> FilterConfig:
    """Only ``family``'s rules, at their defaults (no language id, no Gopher rule)."""
    return FilterConfig(languages=(), **{rule: None for rule in RULE_ORDER if rule != "language"},
                        families={family: {}})


def agreement_row(ours: list[bool], peer: list[bool], whitespace: list[bool] | None) -> dict:
    n = len(ours)
    row = {"agreement": round(sum(a == b for a, b in zip(ours, peer)) / n, 4),
           "ours_only": sum(a and not b for a, b in zip(ours, peer)),
           "datatrove_only": sum(b and not a for a, b in zip(ours, peer)),
           "ours_drops": sum(ours), "datatrove_drops": sum(peer)}
    if whitespace is not None:
        row["agreement_whitespace_words"] = round(sum(a == b for a, b in zip(ours, whitespace)) / n, 4)
    return row


def family_comparison(docs: pl.DataFrame, peer: dict, repeats: int, megabytes: float) -> dict:
    """Per family: CPU seconds of ours and DataTrove's, and per rule the agreement of the decisions
    (for c4's line rules: documents on which both remove the same number of lines)."""
    n = docs.height
    speed, rules = {}, {}
    for family in OPTIONAL_FAMILIES:
        seconds, result = our_pass(docs, family_config(family), repeats)
        speed[family] = {"ours_cpu_s": round(seconds, 3), "datatrove_cpu_s": round(peer["family_cpu_s"][family], 3),
                         "ours_mb_s": round(megabytes / seconds, 2),
                         "datatrove_mb_s": round(megabytes / peer["family_cpu_s"][family], 3),
                         "speedup": round(peer["family_cpu_s"][family] / seconds, 1)}
        failed = dict(zip(result.dropped["id"].to_list(), result.dropped["failed_rules"].to_list()))
        for rule in (r for r in RULES if r.family == family and r.unit == "document"):
            ours = [rule.name in failed.get(i, ()) for i in docs["id"].to_list()]
            theirs = [d != "kept" for d in peer["family_rules"][rule.name]]
            whitespace = peer["family_rules_whitespace"].get(rule.name)
            rules[rule.name] = agreement_row(ours, theirs, None if whitespace is None else
                                             [d != "kept" for d in whitespace])
    on = {r.key: r.default for r in RULES if r.family == "c4"}
    stats, texts, _ = c4_statistics(docs["text"], on)
    for label, name in C4_LINE_RULES.items():
        ours = stats[f"lines_removed/{name}"].to_list()
        theirs = [removed.get(label, 0) for removed in peer["c4_line_removals"]]
        rules[name] = {"agreement": round(sum(a == b for a, b in zip(ours, theirs)) / n, 4),
                       "ours_lines": int(sum(ours)), "datatrove_lines": int(sum(theirs))}
    both = [(a, b) for a, b in zip(texts.to_list(), peer["c4_texts"]) if b is not None]
    text_agreement = round(sum(a == b for a, b in both) / len(both), 4) if both else None
    return {"speed": speed, "rules": rules, "c4_same_text": text_agreement, "c4_texts_compared": len(both)}


def print_families(comparison: dict) -> None:
    print(f"{'family':<20} {'ours CPU s':>10} {'DT CPU s':>9} {'ours MB/s/core':>15} {'DT MB/s/core':>13} {'x':>6}")
    for family, row in comparison["speed"].items():
        print(f"{family:<20} {row['ours_cpu_s']:>10.2f} {row['datatrove_cpu_s']:>9.2f} {row['ours_mb_s']:>15.2f}"
              f" {row['datatrove_mb_s']:>13.3f} {row['speedup']:>6.1f}")
    print(f"{'rule':<46} {'agree':>7} {'ours only':>10} {'DT only':>8} {'ours':>6} {'DT':>6}"
          f" {'agree, DT whitespace':>21}")
    for rule, row in comparison["rules"].items():
        if "ours_lines" in row:
            print(f"{rule:<46} {row['agreement']:>7.1%}   lines removed: ours {row['ours_lines']}, "
                  f"DataTrove {row['datatrove_lines']} (agreement: documents with the same count)")
            continue
        ws = row.get("agreement_whitespace_words")
        print(f"{rule:<46} {row['agreement']:>7.1%} {row['ours_only']:>10} {row['datatrove_only']:>8}"
              f" {row['ours_drops']:>6} {row['datatrove_drops']:>6} {'' if ws is None else f'{ws:.1%}':>21}")
    print(f"c4 text kept, identical to DataTrove's: {comparison['c4_same_text']:.1%} of the "
          f"{comparison['c4_texts_compared']} documents DataTrove keeps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=3000, help="~2 KB pieces of the text corpus")
    parser.add_argument("--pages", type=int, default=300, help="web pages through our HTML extractor")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--venv", type=Path, help="an environment that already has datatrove")
    args = parser.parse_args()

    docs = load_corpus(args.docs, args.pages)
    n = docs.height
    megabytes = sum(len(t.encode()) for t in docs["text"].to_list()) / 1e6
    gopher_cfg = FilterConfig(languages=(), max_duplicate_line_fraction=None, max_duplicate_paragraph_fraction=None)
    all_cfg = FilterConfig(languages=())
    assert set(enabled_rules(gopher_cfg)) == set(GOPHER_RULES)
    ours_gopher_s, ours_gopher = our_pass(docs, gopher_cfg, args.repeats)
    ours_all_s, ours_all = our_pass(docs, all_cfg, args.repeats)

    with tempfile.TemporaryDirectory(prefix="curation-peer-") as tmp:
        tmp_path = Path(tmp)
        start = time.perf_counter()
        python = args.venv / "bin" / "python" if args.venv else make_environment(tmp_path / "venv")
        install_s = time.perf_counter() - start
        (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs["text"]))
        (tmp_path / "rules.json").write_text(json.dumps([GOPHER_RULES, GOPHER_OFF]))
        (tmp_path / "worker.py").write_text(WORKER)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.run([str(python), str(tmp_path / "worker.py"), str(tmp_path / "docs.jsonl"),
                               str(tmp_path / "rules.json"), str(args.repeats)],
                              capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"datatrove worker failed: {proc.stderr.strip()[-3000:]}")
        peer = json.loads(proc.stdout.strip().splitlines()[-1])

    print(f"{n} documents ({(docs['kind'] == 'web').sum()} web pages), {megabytes:.1f} MB; datatrove environment "
          f"{'reused' if args.venv else f'built in {install_s:.0f} s'}; load average {os.getloadavg()[0]:.1f}")
    rows = [("ours: Gopher rules", ours_gopher_s), ("ours: all rules (no langid)", ours_all_s),
            ("DataTrove GopherQualityFilter", peer["gopher_cpu_s"]), ("DataTrove C4QualityFilter", peer["c4_cpu_s"]),
            ("DataTrove Gopher + C4", peer["gopher_cpu_s"] + peer["c4_cpu_s"])]
    print(f"{'filter':<32} {'CPU s':>7} {'docs/s/core':>12} {'MB/s/core':>10}")
    for label, seconds in rows:
        print(f"{label:<32} {seconds:>7.2f} {n / seconds:>12.0f} {megabytes / seconds:>10.2f}")
    speedup = peer["gopher_cpu_s"] / ours_gopher_s
    print(f"ours (Gopher rules) vs DataTrove Gopher: {speedup:.1f}x per core; ours (all rules) vs DataTrove "
          f"Gopher + C4: {(peer['gopher_cpu_s'] + peer['c4_cpu_s']) / ours_all_s:.1f}x")

    mine = our_rule_failures(docs, ours_gopher)
    agreement = {}
    print(f"{'rule':<30} {'agree':>7} {'ours only':>10} {'DT only':>8} {'ours drops':>11} {'DT drops':>9}"
          f" {'agree, DT on whitespace words':>30}")
    for rule in GOPHER_RULES:
        a, b, w = mine[rule], peer["rules"][rule], peer["rules_whitespace"][rule]
        same = sum(x == y for x, y in zip(a, b))
        only_ours = sum(x and not y for x, y in zip(a, b))
        only_peer = sum(y and not x for x, y in zip(a, b))
        same_ws = sum(x == y for x, y in zip(a, w))
        agreement[rule] = {"agreement": round(same / n, 4), "ours_only": only_ours, "datatrove_only": only_peer,
                           "ours_drops": sum(a), "datatrove_drops": sum(b),
                           "agreement_whitespace_words": round(same_ws / n, 4)}
        print(f"{rule:<30} {same / n:>7.1%} {only_ours:>10} {only_peer:>8} {sum(a):>11} {sum(b):>9}"
              f" {same_ws / n:>30.1%}")
    ours_kept = [True] * n
    for i in ours_gopher.dropped["id"].cast(pl.Int64).to_list():
        ours_kept[i] = False
    overall = sum((g == "kept") == k for g, k in zip(peer["gopher"], ours_kept)) / n
    c4_reasons: dict[str, int] = {}
    for reason in peer["c4"]:
        c4_reasons[reason] = c4_reasons.get(reason, 0) + 1
    all_kept = [True] * n
    for i in ours_all.dropped["id"].cast(pl.Int64).to_list():
        all_kept[i] = False
    c4_vs_ours = sum((c == "kept") == k for c, k in zip(peer["c4"], all_kept)) / n
    print(f"whole-filter agreement, ours (Gopher rules) vs GopherQualityFilter: {overall:.1%}")
    families = family_comparison(docs, peer, args.repeats, megabytes)
    print_families(families)
    print(f"C4QualityFilter decisions: {c4_reasons}; same keep/drop as ours (all rules): {c4_vs_ours:.1%} "
          "(no rule of ours is meant to match C4's)")
    print(json.dumps({
        "documents": n, "megabytes": round(megabytes, 2), "load_average": round(os.getloadavg()[0], 1),
        "cpu_s": {label: round(s, 3) for label, s in rows},
        "docs_per_s_per_core": {label: round(n / s, 1) for label, s in rows},
        "speedup_vs_gopher": round(speedup, 2), "rule_agreement": agreement,
        "gopher_overall_agreement": round(overall, 4),
        "c4_reasons": c4_reasons, "c4_vs_ours_all": round(c4_vs_ours, 4), "families": families,
    }))


if __name__ == "__main__":
    main()
