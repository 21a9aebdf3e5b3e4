"""Eval suites as data: validation at load, identity, and Marin's CORE_TASKS rendered for lm-eval (not run)."""

import pytest

from marin_assets.evaluation.next_line import render_task_yaml
from marin_assets.evaluation.suites import (
    SuiteError,
    lm_eval_task_files,
    lm_eval_version,
    load_suites,
    margin_over_chance,
    parse_suites,
    render_harness_config,
    render_task_spec,
    suite_identity,
)

OFFLINE = {"tiny_next_line": {"source": "stdlib-docs"}}


def suites(**suite_bodies):
    return {"offline_tasks": OFFLINE, "suites": suite_bodies, "default_suite": next(iter(suite_bodies))}


@pytest.mark.parametrize("body, problem", [
    ({"tasks": [{"task": "tiny_next_line", "limit": 0}]}, "limit: must be an integer >= 1, got 0"),
    ({"tasks": [{"task": "tiny_next_line", "limit": -3}]}, "limit: must be an integer >= 1"),
    ({"tasks": []}, "the suite is empty"),
    ({}, "the suite is empty"),
    ({"tasks": [{"task": "tiny_next_line", "shots": 5}]}, "unknown field(s) ['shots']"),
    ({"tasks": [{"task": "hellaswag"}, {"task": "hellaswag", "num_fewshot": 10}]}, "listed twice; give one an 'alias'"),
    ({"tasks": [{"task": "tiny_next_line", "num_fewshot": -1}]}, "num_fewshot: must be an integer >= 0"),
    ({"bpb": ["a", "a"]}, "bpb: contains duplicates"),
    ({"tasks": [{"task": "tiny_next_line", "hard": "yes"}]}, "hard: must be true or false, got 'yes'"),
])
def test_bad_suites_are_refused_at_load(body, problem):
    with pytest.raises(SuiteError) as info:
        parse_suites(suites(s=body), "suites.yaml")
    assert problem in str(info.value) and "suites.yaml: suites.s" in str(info.value)


def test_no_suites_unknown_default_and_bad_offline_task_are_refused():
    with pytest.raises(SuiteError, match="non-empty 'suites:'"):
        parse_suites({"suites": {}, "default_suite": "x"})
    with pytest.raises(SuiteError, match="default_suite 'nope' is not a declared suite"):
        parse_suites({"suites": {"s": {"bpb": ["a"]}}, "default_suite": "nope"})
    with pytest.raises(SuiteError, match="offline_tasks.t: .*choices must be at least 2"):
        parse_suites({"offline_tasks": {"t": {"source": "s", "choices": 1}}, "suites": {"s": {"bpb": ["a"]}},
                      "default_suite": "s"})


def test_bundled_suites_load_and_the_default_is_offline():
    registry = load_suites()
    suite = registry.suite()
    assert suite.tasks and not suite.needs_hub
    assert all(t.task in registry.offline_tasks for t in suite.tasks)
    # Word order is what beats_chance requires of the demo model; line end is recorded as the hard task.
    assert {t.task: t.hard for t in suite.tasks} == {"shakespeare_word_order": False, "shakespeare_line_end": True}
    assert margin_over_chance({"t/acc": 0.5, "t/acc_stderr": 0.02}, "t", 0.25) == pytest.approx(0.21)
    assert margin_over_chance({"t/acc": 0.5}, "t", 0.25) is None
    with pytest.raises(SuiteError, match="no suite named 'nope'"):
        registry.suite("nope")


@pytest.mark.slow  # lm-eval's task registry
def test_core_tasks_render_a_valid_lm_eval_config():
    """Marin's CORE_TASKS: every task is in lm-eval's registry, the rendered spec is Levanter's TaskConfig and
    lm-eval's own TaskConfig accepts each entry; nothing is downloaded or run."""
    from levanter.eval_harness import LmEvalHarnessConfig, TaskConfig
    from lm_eval.api.task import TaskConfig as LmEvalTaskConfig

    registry = load_suites()
    core = registry.suite("core")
    assert core.needs_hub and not registry.offline_tasks_of(core)
    spec = render_task_spec(core)
    names = [t.get("task_alias", t["task"]) for t in spec]
    assert {"arc_easy", "arc_challenge", "boolq", "hellaswag_0shot", "hellaswag_10shot", "piqa",
            "winogrande"} <= set(names) and len(names) == len(set(names)) == 13
    harness = LmEvalHarnessConfig(task_spec=[TaskConfig(**t) for t in spec])
    assert harness.to_task_spec() == spec
    for entry in spec:
        files = lm_eval_task_files(entry["task"])
        assert files and all(f.suffix == ".yaml" for f in files)
        LmEvalTaskConfig(task=entry["task"], num_fewshot=entry["num_fewshot"])
    rendered = render_harness_config(registry, core)
    assert rendered["include_bundled_tasks"] and rendered["task_dir"] is None
    assert [g["limit"] for g in rendered["groups"]] == [None]
    identity = suite_identity(registry, core)
    assert identity["lm_eval"] == lm_eval_version() == "0.4.13"
    assert set(identity["task_configs"]) == set(names) and all(identity["task_configs"].values())
    # The same lm-eval task at two shot counts shares its config hash but not its name.
    assert identity["task_configs"]["hellaswag_0shot"] == identity["task_configs"]["hellaswag_10shot"]


def test_an_unknown_lm_eval_task_is_one_clear_line():
    with pytest.raises(SuiteError) as info:
        lm_eval_task_files("arc_easyy")
    message = str(info.value)
    assert "\n" not in message and "unknown lm-eval task 'arc_easyy'" in message and "0.4.13" in message
    registry = parse_suites(suites(s={"tasks": ["arc_easyy"]}))
    assert suite_identity(registry, registry.suite())["task_configs"] == {"arc_easyy": None}


def test_identity_changes_with_what_defines_results():
    base = parse_suites(suites(s={"tasks": [{"task": "tiny_next_line", "limit": 100}]}))
    limit = parse_suites(suites(s={"tasks": [{"task": "tiny_next_line", "limit": 200}]}))
    choices = parse_suites({**suites(s={"tasks": [{"task": "tiny_next_line", "limit": 100}]}),
                            "offline_tasks": {"tiny_next_line": {"source": "stdlib-docs", "choices": 5}}})
    described = parse_suites(suites(s={"description": "other words", "tasks": [{"task": "tiny_next_line",
                                                                                 "limit": 100}]}))
    hard = parse_suites(suites(s={"tasks": [{"task": "tiny_next_line", "limit": 100, "hard": True}]}))
    ids = [suite_identity(r, r.suite()) for r in (base, limit, choices, described, hard)]
    # What the check requires (`hard`) is a policy, not what the results are.
    assert ids[0] != ids[1] and ids[0] != ids[2] and ids[0] == ids[3] == ids[4]
    assert hard.suite().tasks[0].hard and not base.suite().tasks[0].hard
    spec = base.offline_tasks["tiny_next_line"]
    assert ids[0]["task_configs"]["tiny_next_line"] != ids[2]["task_configs"]["tiny_next_line"]
    assert "tiny_next_line" in render_task_yaml(spec, "x.jsonl")


def test_tasks_are_grouped_by_limit():
    registry = parse_suites(suites(s={"tasks": [{"task": "tiny_next_line", "limit": 50}, {"task": "piqa"},
                                                {"task": "copa", "limit": 50}]}))
    rendered = render_harness_config(registry, registry.suite(), "/tasks")
    assert [(g["limit"], [t["task"] for t in g["task_spec"]]) for g in rendered["groups"]] == \
        [(50, ["tiny_next_line", "copa"]), (None, ["piqa"])]
    assert rendered["include_bundled_tasks"] and rendered["offline_tasks"] == {
        "tiny_next_line": {"task": "tiny_next_line", "choices": 4}}


def test_a_project_section_extends_the_bundled_suites_by_name():
    bundled = load_suites()
    notes = {"tasks": [{"task": "notes_line_end", "limit": 50}], "bpb": ["notes"]}
    extended = parse_suites({"offline_tasks": {"notes_line_end": {"source": "notes", "continuation": "line_end"}},
                             "suites": {"notes": notes}, "runs": {"tiny": "notes"}},
                            "marin.yaml: eval_suites", extends=bundled)
    assert set(extended.suites) == set(bundled.suites) | {"notes"}
    assert set(extended.offline_tasks) == set(bundled.offline_tasks) | {"notes_line_end"}
    assert extended.default_suite == bundled.default_suite  # not named: kept
    assert extended.suite_of_run("tiny").name == "notes"
    assert extended.suite_of_run("nano-shakespeare") == bundled.suite_of_run("nano-shakespeare")
    assert extended.suite_of_run("any-other-run").name == bundled.default_suite
    assert parse_suites({"default_suite": "notes"}, "p", extends=extended).suite_of_run("any-other-run").name == "notes"
    assert extended.with_default("core", "MARIN_EVAL_SUITE").suite_of_run("any-other-run").name == "core"


@pytest.mark.parametrize("section, problem", [
    ({"runs": {"tiny": "nope"}}, "marin.yaml: eval_suites: runs.tiny: 'nope' is not a declared suite"),
    ({"runs": ["tiny"]}, "marin.yaml: eval_suites: runs: expected a mapping of run name to suite name"),
    ({"default_suite": "nope"}, "marin.yaml: eval_suites: default_suite 'nope' is not a declared suite"),
    ({"suites": {"s": {}}}, "marin.yaml: eval_suites: suites.s: the suite is empty"),
    ({"suite": {}}, "marin.yaml: eval_suites: unknown field(s) ['suite']"),
])
def test_a_bad_project_section_is_refused_naming_the_file_and_field(section, problem):
    with pytest.raises(SuiteError) as caught:
        parse_suites(section, "marin.yaml: eval_suites", extends=load_suites())
    assert problem in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(SuiteError, match="MARIN_EVAL_SUITE: no suite named 'nope'"):
        load_suites().with_default("nope", "MARIN_EVAL_SUITE")
