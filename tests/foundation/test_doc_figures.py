"""Figures the docs state about the built-in configuration are checked against the code.

A figure is marked where it is written, `<!-- fact:NAME -->2,098,304<!-- /fact -->` (HTML comments do not
render), and `FACTS[NAME]` computes the text it must read from the same config and code the deployment
uses. Measured timings are not facts: they carry their date and machine instead (docs/operations.md,
"Figures in the docs")."""

import re
from functools import cache
from pathlib import Path

import pytest

from marin_assets.scaling_sweeps.config import load_sweeps, plan_sweep
from marin_assets.tokenization.registry import load_registry
from marin_assets.training.spec import load_run_registry

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKED = re.compile(r"<!-- fact:([\w-]+) -->(.*?)<!-- /fact -->", re.DOTALL)
DEMO_RUN, DEMO_SWEEP = "nano-shakespeare", "demo"
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve"]


def listed(items) -> str:
    """`4, 8 and 16`, as the docs list values."""
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def flops(budget: float) -> str:
    """`1.25e10`: the docs' spelling of a FLOP budget."""
    mantissa, exponent = f"{budget:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


@cache
def demo_run():
    return load_run_registry()[DEMO_RUN]


@cache
def demo_vocab() -> int:
    return load_registry().tokenizers[demo_run().tokenizer].config.vocab_size


@cache
def demo_sweep_runs():
    return [run.spec for run in plan_sweep(load_sweeps()[DEMO_SWEEP]).fit_runs()]


def sweep_widths() -> list[int]:
    return sorted({spec.model.hidden_dim for spec in demo_sweep_runs()})


def sweep_layers() -> list[int]:
    """Layers of each width, in width order."""
    depth = {spec.model.hidden_dim: spec.model.num_layers for spec in demo_sweep_runs()}
    return [depth[w] for w in sweep_widths()]


def batch_shape(specs) -> str:
    shapes = {f"{s.train_batch_size} x {s.model.seq_len}" for s in specs}
    assert len(shapes) == 1, f"runs with different batch shapes: {sorted(shapes)}"
    return shapes.pop()


FACTS = {
    "demo_parameters": lambda: f"{demo_run().model.parameter_count(demo_vocab()):,}",
    "demo_vocab": lambda: f"{demo_vocab():,}",
    "demo_layers": lambda: str(demo_run().model.num_layers),
    "demo_width": lambda: str(demo_run().model.hidden_dim),
    "demo_steps": lambda: str(demo_run().num_train_steps),
    "demo_batch": lambda: batch_shape([demo_run()]),
    "sweep_budget_count": lambda: str(len(load_sweeps()[DEMO_SWEEP].fit_budgets)),
    "sweep_budgets": lambda: listed(flops(b) for b in load_sweeps()[DEMO_SWEEP].fit_budgets),
    "sweep_size_count": lambda: str(len(sweep_widths())),
    "sweep_widths": lambda: listed(sweep_widths()),
    "sweep_layers": lambda: listed(sweep_layers()),
    "sweep_run_count": lambda: NUMBER_WORDS[len(demo_sweep_runs())],
    "sweep_steps_range": lambda: f"{min(steps := [s.num_train_steps for s in demo_sweep_runs()])} to {max(steps)}",
    "sweep_total_steps": lambda: f"{sum(s.num_train_steps for s in demo_sweep_runs()):,}",
    "sweep_batch": lambda: batch_shape(demo_sweep_runs()),
}


def stale_figures(name: str, text: str) -> list[str]:
    """One line per marked figure in `text` that is not what the code gives, or names no known fact."""
    problems = []
    for match in MARKED.finditer(text):
        fact, stated = match.group(1), " ".join(match.group(2).split())
        line = text.count("\n", 0, match.start()) + 1
        if fact not in FACTS:
            problems.append(f"{name}:{line}: unknown fact {fact!r} (known: {', '.join(sorted(FACTS))})")
        elif stated != (actual := FACTS[fact]()):
            problems.append(f"{name}:{line}: {fact} reads {stated!r}, the code gives {actual!r}")
    return problems


def test_every_marked_figure_is_what_the_code_computes():
    problems = [p for doc in DOCS for p in stale_figures(str(doc.relative_to(REPO)), doc.read_text())]
    assert not problems, "\n".join(problems)


def test_every_fact_is_stated_in_the_docs():
    stated = {m.group(1) for doc in DOCS for m in MARKED.finditer(doc.read_text())}
    assert sorted(set(FACTS) - stated) == []


@pytest.mark.parametrize("text, problem", [
    ("a <!-- fact:demo_parameters -->1.3 M<!-- /fact --> model", "demo_parameters reads '1.3 M'"),
    ("a <!-- fact:demo_vocab -->1024<!-- /fact -->-token vocabulary", "demo_vocab reads '1024', the code gives "),
    ("\n\n<!-- fact:demo_params -->1<!-- /fact -->", "x.md:3: unknown fact 'demo_params'"),
])
def test_a_figure_that_drifted_is_reported_with_its_place(text, problem):
    [reported] = stale_figures("x.md", text)
    assert problem in reported

