"""HTML to text: Resiliparse against trafilatura, on real pages found on this machine.

Pages: `marin_assets.curation.web.reference_pages()` (Debian's Python documentation when
`python3.11-doc` is installed, other HTML documentation under /usr/share/doc, HTML inside
installed packages), kept when their own markup marks a main region and navigation
(`page_regions`: <main>, role=main, Sphinx's div.body ... against <nav>, role=navigation,
sidebars, headers, footers). That markup is the reference, so neither extractor is judged by
the other:

* word precision / recall / F1: the extracted words against the main region's words, as bags
  (a word counts as often as it occurs in both);
* navigation leaked: the share of the pages' navigation lines (2+ words, not also in the main
  text) that appear verbatim in the extract;
* speed: CPU seconds over all pages (so the shared machine's load matters less), as MB of HTML
  and pages per second per core.

Extractors: `resiliparse` is `web.html_to_text` as the readers call it; `trafilatura` is the
call the readers made before (`extract(favor_recall=True, include_tables=True)` plus
`extract_metadata` for the title); `trafilatura-precision` is trafilatura's default balance.

    python -m benchmarks.html_extract [--pages 400]

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import Counter
from pathlib import Path

from marin_assets.curation.web import PageRegions, html_to_text, page_regions, reference_pages

_WORD_RE = re.compile(r"\w+")
_SPACE_RE = re.compile(r"\s+")


def _trafilatura_recall(html: str) -> str:
    import trafilatura

    text = trafilatura.extract(html, include_comments=False, include_tables=True, favor_recall=True) or ""
    trafilatura.extract_metadata(html)  # the readers also took the title from it
    return text


def _trafilatura_default(html: str) -> str:
    import trafilatura

    return trafilatura.extract(html, include_comments=False, include_tables=True) or ""


EXTRACTORS = {
    "resiliparse": lambda html: html_to_text(html)[0],
    "trafilatura": _trafilatura_recall,
    "trafilatura-precision": _trafilatura_default,
}


def _family(path: Path) -> str:
    text = str(path)
    if text.startswith("/usr/share/doc/python3"):
        return "python-docs (Sphinx)"
    if text.startswith("/usr/share/doc/"):
        return "other /usr/share/doc"
    return "installed packages"


def load_pages(limit: int) -> list[tuple[Path, str, PageRegions]]:
    """Up to ``limit`` pages with a marked-up main region and navigation, the families in turn
    (so Sphinx pages cannot crowd out the others), each family's pages spread over its list."""
    by_family: dict[str, list[tuple[Path, str, PageRegions]]] = {}
    for path in reference_pages():
        try:
            html = path.read_text("utf-8", errors="replace")
        except OSError:
            continue
        regions = page_regions(html)
        if regions is not None and len(regions.main.split()) >= 50 and regions.navigation:
            by_family.setdefault(_family(path), []).append((path, html, regions))
    chosen: list[tuple[Path, str, PageRegions]] = []
    families = sorted(by_family.values(), key=len)  # smallest first: what they leave goes to the rest
    for left, pages in zip(range(len(families), 0, -1), families):
        take = min(len(pages), (limit - len(chosen)) // left)
        step = max(1, len(pages) // max(take, 1))
        chosen.extend(pages[::step][:take])
    return chosen


def score(extract: str, regions: PageRegions) -> tuple[int, int, int, int, int]:
    """(shared words, extracted words, main words, navigation lines leaked, navigation lines)."""
    got, want = Counter(_WORD_RE.findall(extract.lower())), Counter(_WORD_RE.findall(regions.main.lower()))
    flat = _SPACE_RE.sub(" ", extract)
    leaked = sum(1 for line in regions.navigation if line in flat)
    return sum((got & want).values()), sum(got.values()), sum(want.values()), leaked, len(regions.navigation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=400)
    args = parser.parse_args()
    pages = load_pages(args.pages)
    if not pages:
        raise SystemExit("no HTML page with a marked-up main region and navigation found on this machine")
    megabytes = sum(len(html.encode()) for _, html, _ in pages) / 1e6
    families = Counter(_family(p) for p, _, _ in pages)
    print(f"{len(pages)} pages, {megabytes:.1f} MB of HTML: "
          + ", ".join(f"{n} {family}" for family, n in families.most_common())
          + f"; load average {os.getloadavg()[0]:.1f}")
    summary = {"pages": len(pages), "megabytes": round(megabytes, 2), "families": dict(families), "extractors": {}}
    print(f"{'extractor':<22} {'MB/s/core':>9} {'pages/s':>8} {'precision':>9} {'recall':>7} {'F1':>6} "
          f"{'nav leaked':>11}")
    for name, extract in EXTRACTORS.items():
        totals = Counter()
        cpu = 0.0
        recalls = []
        for path, html, regions in pages:
            start = time.process_time()
            text = extract(html)
            cpu += time.process_time() - start
            shared, got, want, leaked, nav = score(text, regions)
            totals.update(shared=shared, got=got, want=want, leaked=leaked, nav=nav)
            recalls.append((shared / max(want, 1), str(path)))
        recalls.sort()
        precision = totals["shared"] / max(totals["got"], 1)
        recall = totals["shared"] / max(totals["want"], 1)
        f1 = 2 * precision * recall / max(precision + recall, 1e-9)
        leak = totals["leaked"] / max(totals["nav"], 1)
        row = {"mb_per_s_per_core": round(megabytes / cpu, 2), "pages_per_s": round(len(pages) / cpu, 1),
               "precision": round(precision, 4), "recall": round(recall, 4), "f1": round(f1, 4),
               "nav_leaked": round(leak, 4), "cpu_s": round(cpu, 2),
               "median_page_recall": round(recalls[len(recalls) // 2][0], 4),
               "lowest_recall_pages": [(round(r, 3), p) for r, p in recalls[:5]]}
        summary["extractors"][name] = row
        print(f"{name:<22} {row['mb_per_s_per_core']:>9.2f} {row['pages_per_s']:>8.1f} {precision:>9.3f} "
              f"{recall:>7.3f} {f1:>6.3f} {leak:>10.1%}  median page recall {row['median_page_recall']:.3f}")
    summary["load_average"] = round(os.getloadavg()[0], 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
