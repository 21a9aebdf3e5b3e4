import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scaling.__main__ import main

REPO = Path(__file__).resolve().parents[2]
BUDGETS = np.geomspace(1e18, 1e21, 5)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "scaling", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow  # a CLI process and a bootstrap
def test_isoflop_cli_prints_optima_law_and_predictions(tmp_path, known_law, csv_writer):
    rows = known_law.sweep(BUDGETS, noise=0.003, seed=2)
    for row in rows:
        row["run_name"] = "ignored"
    csv_path = csv_writer(tmp_path / "runs.csv", rows)
    plot = tmp_path / "fit.png"
    result = run_cli("isoflop", str(csv_path), "--predict", "1e22,1e23", "--plot", str(plot), "--bootstrap", "50")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert [sorted(o) for o in out["optima"]] == [sorted(["flops", "params", "tokens", "loss", "runs", "interior"])] * 5
    assert {"E", "A", "alpha", "params_coef", "params_exponent", "tokens_coef", "tokens_exponent"} <= set(out["law"])
    assert [p["flops"] for p in out["predictions"]] == [1e22, 1e23]
    for p in out["predictions"]:
        assert p["loss_low"] <= p["loss"] <= p["loss_high"]
        assert {"params", "params_low", "params_high", "tokens", "tokens_low", "tokens_high"} <= set(p)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a CLI process and the full fit
def test_chinchilla_cli_derives_tokens_when_missing(tmp_path, known_law, capsys, csv_writer):
    rng = np.random.default_rng(5)
    n = np.exp(rng.uniform(np.log(1e7), np.log(1e10), 40))
    d = np.exp(rng.uniform(np.log(1e9), np.log(1e12), 40))
    rows = [{"flops": 6 * a * b, "params": a, "loss": known_law.loss(a, b)} for a, b in zip(n, d)]
    assert main(["chinchilla", str(csv_writer(tmp_path / "points.csv", rows))]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"E", "A", "B", "alpha", "beta", "objective", "starts", "seconds"}
    assert out["starts"] == 4500
    assert out["alpha"] == pytest.approx(known_law.alpha, rel=1e-3)
    assert out["beta"] == pytest.approx(known_law.beta, rel=1e-3)


GOOD = {"flops": 1e18, "params": 1e8, "tokens": 1.6e9, "loss": 3.0}


@pytest.mark.parametrize(
    "rows,columns,message",
    [
        ([GOOD], ["flops", "params", "loss"], "missing required column(s) tokens"),
        ([GOOD, {**GOOD, "loss": "n/a"}], None, "row 2, column 'loss': not a number: 'n/a'"),
        ([GOOD, {**GOOD, "params": 0}], None, "row 2, column 'params': must be positive"),
        ([GOOD, {**GOOD, "tokens": ""}], None, "row 2, column 'tokens': empty value"),
        ([GOOD, GOOD], None, "budget 1e+18 FLOPs has 2 run(s); a quadratic fit needs at least 3"),
    ],
    ids=["missing-column", "non-numeric", "non-positive", "empty", "too-few-runs"],
)
def test_isoflop_cli_rejects_bad_csv(tmp_path, capsys, csv_writer, rows, columns, message):
    path = csv_writer(tmp_path / "bad.csv", rows, columns)
    assert main(["isoflop", str(path), "--predict", "1e21"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err
    assert str(path) in captured.err or "budget" in message


def test_missing_file_exits_nonzero_from_a_real_process(tmp_path):
    missing = run_cli("isoflop", str(tmp_path / "nope.csv"), "--predict", "1e21")
    assert missing.returncode == 2
    assert missing.stdout == ""
    assert "no such file" in missing.stderr


def test_empty_file_and_bad_arguments(tmp_path, capsys):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert main(["chinchilla", str(empty)]) == 2
    assert "empty file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["isoflop", str(empty), "--predict", "1e21,abc"])
    assert exit_info.value.code == 2
    assert "comma-separated FLOPs" in capsys.readouterr().err
    assert main(["isoflop", str(empty), "--predict", "1e21", "--interval", "1.5"]) == 2
    assert "interval must be in (0, 1)" in capsys.readouterr().err


def test_recipe_cli_lists_candidates(capsys):
    assert main(["recipe", "micro", "1e13,1e14"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {c["budget"] for c in out} == {1e13, 1e14}
    assert all(c["recipe"] == "micro" for c in out)


def test_isoflop_cli_refuses_convex_profiles_whose_minima_lie_beyond_the_sampled_tokens(tmp_path, known_law,
                                                                                        csv_writer):
    """Every budget sampled only models 2-32x too large: each valley is convex, but its vertex is an
    extrapolation past the most tokens sampled. One line, exit 2, nothing on stdout; the plot asked for
    shows the profiles under the refusal."""
    rows = known_law.sweep(BUDGETS[:3], sizes_per_budget=5, centre=8.0, noise=0.002, seed=2)
    plot = tmp_path / "fit.png"
    result = run_cli("isoflop", str(csv_writer(tmp_path / "runs.csv", rows)), "--predict", "1e22", "--plot", str(plot))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: not enough interior optima: 0 of 3 budget(s)") and \
        result.stderr.count("\n") == 1, result.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
