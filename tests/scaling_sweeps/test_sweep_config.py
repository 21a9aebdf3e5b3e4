import re

import pytest
import yaml

from marin_assets.scaling_sweeps.config import (
    DEFAULT_SWEEPS_YAML,
    SweepConfigError,
    budget_label,
    load_sweeps,
    plan_sweep,
    run_name,
    safe_name,
    sweep_from_dict,
)
from marin_assets.training.spec import RunSpec, validate_run

PATH_SAFE = re.compile(r"^[A-Za-z0-9._=+-]+$")

BASE = {
    "recipe": "micro",
    "recipe_overrides": {"vocab_size": 4096, "seq_len": 128},
    "mixture": "m",
    "tokenizer": "t",
    "eval_set": "m",
    "fit_budgets": [2e12, 4e12, 1e13],
    "target_budgets": [1e14],
}


def test_shipped_sweeps_plan_valid_path_safe_runs():
    sweeps = load_sweeps(DEFAULT_SWEEPS_YAML)
    assert "micro-delphi" in sweeps
    for config in sweeps.values():
        plan = plan_sweep(config)
        names = [r.spec.name for b in plan.budgets for r in b.runs]
        assert len(names) == len(set(names))
        for budget in plan.budgets:
            if budget.role == "fit":
                assert len(budget.runs) >= 3
            for run in budget.runs:
                assert PATH_SAFE.match(run.spec.name) and not run.spec.name.startswith(".")
                assert run.spec.name.startswith(f"{config.name}-{budget_label(budget.budget)}-d")
                validate_run(run.spec)
                # The spec trains exactly the planned tokens, on the planned shape, evaluating the fitted set.
                assert run.spec.num_train_steps * run.spec.tokens_per_step == run.candidate.tokens
                assert run.spec.model.parameter_count(run.candidate.vocab_size) == run.candidate.params
                assert run.spec.eval_sets == (config.eval_set,)
                assert RunSpec.from_dict(run.spec.name, run.spec.identity()).fingerprint() == run.spec.fingerprint()


def test_budget_labels_and_names_are_path_safe():
    assert budget_label(3e12) == "3e12"
    assert budget_label(2.5e13) == "2.5e13"
    assert budget_label(1.5e11) == "1.5e11"
    assert run_name("my sweep/x", 1e12, 32) == "my-sweep-x-1e12-d32"
    assert safe_name("..a b") == "a-b"
    with pytest.raises(ValueError):
        safe_name("///")


def test_max_steps_drops_candidates_with_a_reason():
    config = sweep_from_dict("s", {**BASE, "max_steps": 10_000})
    uncapped = plan_sweep(config)
    longest = max(r.spec.num_train_steps for r in uncapped.fit_runs())
    capped = plan_sweep(sweep_from_dict("s", {**BASE, "max_steps": longest - 1}))
    assert all(r.spec.num_train_steps < longest for r in capped.fit_runs())
    assert any("max_steps" in x.reason for b in capped.budgets for x in b.rejected)


@pytest.mark.parametrize("change, field", [
    ({"fit_budgets": [1e12, 2e12]}, "fit_budgets"),
    ({"target_budgets": [5e12]}, "target_budgets[0]"),
    ({"recipe": "huge"}, "recipe"),
    ({"recipe_overrides": {"vocab": 10}}, "recipe_overrides.vocab"),
    ({"target_recipe_overrides": {"vocab": 10}}, "target_recipe_overrides.vocab"),
    ({"target_recipe_overrides": {"min_tokens_per_param": 2000.0}}, "target_recipe_overrides"),
    ({"params": "embedding"}, "params"),
    ({"colour": "red"}, "colour"),
    ({"fit_budgets": [1e12, "lots", 3e12]}, "fit_budgets[1]"),
    ({"watch_every": -5}, "watch_every"),
])
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(SweepConfigError) as info:
        sweep_from_dict("s", {**BASE, **change})
    assert info.value.field_path == field


def test_a_fit_budget_without_three_candidates_is_an_error():
    with pytest.raises(SweepConfigError, match="isoFLOP fit needs 3"):
        plan_sweep(sweep_from_dict("s", {**BASE, "fit_budgets": [1e9, 4e12, 1e13]}))


def test_yaml_exponents_without_a_dot_are_numbers(tmp_path):
    path = tmp_path / "sweeps.yaml"
    text = yaml.safe_dump({"sweeps": {"s": {**BASE, "fit_budgets": ["FIT"]}}}).replace("- FIT", "[2e12, 4e12, 1e13]")
    path.write_text(text.replace("fit_budgets:\n", "fit_budgets: "))
    assert load_sweeps(path)["s"].fit_budgets == (2e12, 4e12, 1e13)


def test_target_recipe_overrides_widen_only_the_target_budgets():
    narrow = plan_sweep(sweep_from_dict("s", BASE))
    wide_config = sweep_from_dict("s", {**BASE, "target_recipe_overrides": {"max_tokens_per_param": 100_000.0}})
    wide = plan_sweep(wide_config)
    assert [r.spec.name for r in wide.fit_runs()] == [r.spec.name for r in narrow.fit_runs()]
    narrow_target = {r.spec.name for r in narrow.target_candidates(1e14)}
    wide_target = {r.spec.name for r in wide.target_candidates(1e14)}
    assert narrow_target < wide_target  # smaller models, at more tokens per parameter
    assert wide_config.identity()["resolved_target_recipe"]["max_tokens_per_param"] == 100_000.0
    assert wide_config.identity() != sweep_from_dict("s", BASE).identity()


def test_watch_every_reaches_every_run_and_no_fingerprint():
    watched = sweep_from_dict("s", BASE)
    unwatched = sweep_from_dict("s", {**BASE, "watch_every": 0})
    assert unwatched.identity() == watched.identity()
    pairs = zip(plan_sweep(watched).fit_runs(), plan_sweep(unwatched).fit_runs())
    for a, b in pairs:
        assert (a.spec.watch_every, b.spec.watch_every) == (10, 0)
        assert a.spec.fingerprint() == b.spec.fingerprint()
