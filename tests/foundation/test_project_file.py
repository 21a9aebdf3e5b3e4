"""The project file, `marin.yaml`: found by MARIN_CONFIG / --config / the working directory, extending
the built-in definitions without changing them, naming the store, refused strictly in one line."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from marin_assets.deployment import Deployment
from marin_resources.environments import MarinSettings
from marin_resources.typed_config import ConfigError

REPO = Path(__file__).resolve().parents[2]
MODEL = ("{hidden_dim: 32, intermediate_dim: 64, num_layers: 2, num_heads: 2, num_kv_heads: 2, seq_len: 64}, "
         "optimizer: {learning_rate: 0.01}, train_batch_size: 8")
RUN = f"{{mixture: notes, tokenizer: notes, model: {MODEL}, num_train_steps: 5}}"
NOTES = f"""
store: store
filters: {{min_words: 20}}
sources:
  - {{name: notes, uri: texts/*.txt, format: text, strip_gutenberg: false}}
tokenizers:
  notes: {{train_on: [notes], vocab_size: 512}}
tokenized:
  notes: {{tokenizer: notes, validation_fraction: 0.1}}
mixtures:
  notes: {{tokenizer: notes, components: {{notes: {{weight: 1.0}}}}}}
eval_suites:
  offline_tasks:
    notes_line_end: {{source: notes, continuation: line_end, distractors: other_documents, min_chars: 10}}
  suites:
    notes: {{tasks: [{{task: notes_line_end, limit: 50}}], bpb: [notes]}}
  runs: {{tiny: notes}}
  default_suite: notes
runs:
  tiny: {RUN}
"""


def project(tmp_path: Path, text: str, name: str = "marin.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(cwd: Path, **environ: str) -> tuple[MarinSettings, Deployment]:
    settings = MarinSettings.from_env(environ, cwd=cwd)
    return settings, Deployment.load(settings)


@pytest.fixture
def builtin(tmp_path) -> Deployment:
    """The deployment of the bundled files alone (a directory without a project file)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    settings, deployment = load(empty)
    assert settings.project is None and settings.prefix_named_by == "default"
    return deployment


def test_the_project_file_adds_to_the_builtins_and_changes_none_of_them(tmp_path, builtin):
    path = project(tmp_path, NOTES)
    settings, deployment = load(tmp_path)
    assert settings.project.path == path
    assert settings.prefix == str(tmp_path / "store") and settings.prefix_named_by == str(path)

    curation = deployment.curation
    assert [s.name for s in curation.sources] == [s.name for s in builtin.curation.sources] + ["notes"]
    notes = curation.source("notes")
    assert notes.uri == f"{tmp_path}/texts/*.txt"  # relative to the project file
    # The project's filter defaults over the built-in ones, for its own sources only.
    assert notes.filters.min_words == 20 and notes.filters.languages == ("en",)
    for source in builtin.curation.sources:
        assert curation.source(source.name) == source
    # Not scored with the built-in sources: their shared keep threshold does not move.
    assert curation.quality_sources == builtin.curation.quality_sources and "notes" not in curation.quality_sources
    assert curation.quality == builtin.curation.quality

    tokenization = deployment.tokenization
    assert set(tokenization.tokenizers) == set(builtin.tokenization.tokenizers) | {"notes"}
    assert tokenization.tokenized["notes"].tokenizer == "notes"
    for name, entry in builtin.tokenization.tokenized.items():
        assert tokenization.tokenized[name] == entry
    assert tokenization.mixtures["notes"].weights == {"notes": 1.0}
    assert {n: m for n, m in tokenization.mixtures.items() if n != "notes"} == builtin.tokenization.mixtures
    assert deployment.runs["tiny"].num_train_steps == 5
    assert {n: r for n, r in deployment.runs.items() if n != "tiny"} == dict(builtin.runs)
    assert deployment.sweeps == builtin.sweeps


def test_an_entry_named_like_a_builtin_replaces_it_and_quality_opts_in(tmp_path, builtin):
    nano = dataclasses.asdict(builtin.runs["nano-shakespeare"])
    project(tmp_path, NOTES + f"""
  nano-shakespeare: {RUN.replace("notes", "shakespeare").replace("steps: 5", "steps: 7")}
quality:
  keep_fraction: 0.5
  sources: [shakespeare, notes]
""")
    _, deployment = load(tmp_path)
    replaced = deployment.runs["nano-shakespeare"]
    assert replaced.num_train_steps == 7 and replaced.model.hidden_dim == 32 != nano["model"]["hidden_dim"]
    curation = deployment.curation
    assert curation.quality_sources == ("shakespeare", "notes")
    # Only the key it names: the classifier and its training sources stay the built-in ones.
    assert curation.quality == dataclasses.replace(builtin.curation.quality, keep_fraction=0.5)
    assert curation.quality_positive_sources == builtin.curation.quality_positive_sources


def test_a_run_or_sweep_declared_by_difference_is_its_resolved_config(tmp_path, builtin):
    """`base:` names a run (or sweep) of the file or a built-in; the fields given replace its own,
    a mapping field by field. The identity is the resolved config's: spelled out whole, the same
    run has the same fingerprint."""
    project(tmp_path, NOTES + """
  deeper: {base: tiny, model: {num_layers: 4}}
  probe: {base: deeper, seed: 1}
  nano-shakespeare: {base: nano-shakespeare, num_train_steps: 600}
sweeps:
  demo-narrow:
    base: demo
    recipe_overrides: {widths: [4, 8, 12]}
""")
    _, by_difference = load(tmp_path)
    runs = by_difference.runs
    assert runs["deeper"] == dataclasses.replace(runs["tiny"], name="deeper",
                                                 model=dataclasses.replace(runs["tiny"].model, num_layers=4))
    spelled = RUN.replace("num_layers: 2", "num_layers: 4").replace("5}", "5, seed: 1}")
    project(tmp_path, NOTES + f"  probe: {spelled}\n")
    spelled_out = load(tmp_path)[1].runs["probe"]
    assert runs["probe"].identity() == spelled_out.identity()
    assert runs["probe"].fingerprint() == spelled_out.fingerprint() != runs["tiny"].fingerprint()
    assert runs["nano-shakespeare"] == dataclasses.replace(builtin.runs["nano-shakespeare"], num_train_steps=600)
    demo, narrow = builtin.sweeps["demo"], by_difference.sweeps["demo-narrow"]
    assert dict(narrow.recipe_overrides) == {**demo.recipe_overrides, "widths": (4, 8, 12)}
    assert narrow == dataclasses.replace(demo, name="demo-narrow", recipe_overrides=narrow.recipe_overrides)
    assert narrow.identity()["resolved_recipe"]["widths"] == (4, 8, 12)
    # Derived from itself with no change: the built-in as it was, so its artifacts keep their fingerprint.
    project(tmp_path, NOTES + "sweeps: {demo: {base: demo}}\n")
    assert load(tmp_path)[1].sweeps["demo"].identity() == demo.identity()


def test_which_file_and_which_store(tmp_path):
    elsewhere = tmp_path / "conf"
    elsewhere.mkdir()
    path = project(elsewhere, "store: gs://bucket/marin\n", "other.yaml")
    project(tmp_path, "store: local\n")
    named = MarinSettings.from_env({"MARIN_CONFIG": str(path)}, cwd=tmp_path)
    assert named.project.path == path and named.prefix == "gs://bucket/marin"
    found = MarinSettings.from_env({}, cwd=tmp_path)
    assert found.prefix == str(tmp_path / "local")  # beside the file, whatever the working directory
    assert MarinSettings.from_env({}, cwd=tmp_path / "conf").project is None
    override = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "x")}, cwd=tmp_path)
    assert override.prefix == str(tmp_path / "x") and override.prefix_named_by == "MARIN_PREFIX"
    with pytest.raises(ConfigError, match=r"^MARIN_CONFIG=nope.yaml: no such project file$"):
        MarinSettings.from_env({"MARIN_CONFIG": "nope.yaml"}, cwd=tmp_path)
    project(tmp_path, "store: ftp://host/x\n")
    refusal = f"{tmp_path}/marin.yaml: store: ftp://host/x: ftp:// is not a store"
    with pytest.raises(ConfigError, match="^" + re.escape(refusal)):
        MarinSettings.from_env({}, cwd=tmp_path)
    # The identities of what it builds do not depend on where the store is.
    project(tmp_path, NOTES)
    here = Deployment.load(MarinSettings.from_env({}, cwd=tmp_path))
    there = Deployment.load(MarinSettings.from_env({"MARIN_PREFIX": "s3://b/p"}, cwd=tmp_path))
    assert here == there



@pytest.mark.parametrize("text, problem", [
    ("- sources\n", "the top level must be a mapping of sections"),
    ("sorces: []\n", "unknown key 'sorces' (allowed: store, filters, sources,"),
    ("store: 3\n", "store: expected a string, got 3 (int)"),
    ("sources: {name: notes}\n", "sources: expected a list, got"),
    ("sources: [{name: n, uri: t/*.txt, min_words: 3}]\n", "source 'n': unknown field 'min_words'"),
    ("sources: [{name: n, uri: t/*.txt, filters: {min_words: ten}}]\n",
     "source 'n'.filters.min_words: expected an integer, got 'ten' (str)"),
    ("filters: {min_word: 3}\n", "filters: unknown field 'min_word'"),
    ("sources: [{name: n, uri: t/*.txt, filters: {families: {c5: {}}}}]\n",
     "source 'n'.filters: families: unknown family 'c5' (known: c4, fineweb, gopher_repetition)"),
    ("filters: {families: {c4: {min_sentence: 3}}}\n", "filters: families.c4: unknown rule 'min_sentence' (known:"),
    ("quality: {sources: [nope]}\n", "quality.sources: 'nope' is not a declared source"),
    ("quality: {keep_fraction: high}\n", "quality.keep_fraction: expected a number"),
    ("tokenizers: {t: {train_on: [shakespeare], vocab_sise: 10}}\n", "tokenizer 't': field 'vocab_sise': unknown"),
    ("tokenizers: {t: {train_on: shakespeare}}\n", "tokenizer 't'.train_on: expected a list"),
    ("tokenizers: {t: {train_on: [nope]}}\n", "tokenizer 't': train_on names a source that is not declared"),
    ("tokenized: {nope: {tokenizer: shakespeare}}\n", "tokenized 'nope': no source named 'nope'"),
    ("tokenized: {shakespeare: {tokenizer: nope}}\n", "tokenized 'shakespeare': tokenizer 'nope' is not declared"),
    ("mixtures: {m: {tokenizer: shakespeare, components: {shakespeare: {weigth: 1}}}}\n",
     "mixture 'm'.components.shakespeare: expected {weight: W}"),
    ("mixtures: {m: {tokenizer: shakespeare, componets: {}}}\n", "mixture 'm': unknown field 'componets'"),
    ("mixtures: {m: {tokenizer: other, components: {shakespeare: {}}}}\n",
     "mixture 'm': every component must use tokenizer 'other'; some use ['shakespeare']"),
    ("mixtures: {m: {tokenizer: shakespeare, components: {nope: {}}}}\n",
     "mixture 'm': component(s) ['nope'] are not tokenized here"),
    (f"runs: {{r: {RUN}}}\n".replace("notes", "shakespeare").replace("steps: 5", "steps: 5, sed: 1"),
     "run 'r': field 'sed': unknown field"),
    (f"runs: {{r: {RUN}}}\n".replace("notes", "shakespeare").replace("steps: 5", "steps: '10'"),
     "run 'r': field 'num_train_steps': expected an integer, got '10' (str)"),
    (f"runs: {{r: {RUN}}}\n", "run 'r': mixture 'notes' with tokenizer 'notes' is not built here"),
    (NOTES.replace("runs: {tiny: notes}", "runs: {tiny: shakespeare}"),
     "run 'tiny' (tokenizer 'notes') is evaluated with suite 'shakespeare' (runs.tiny), whose bpb set "
     "'shakespeare' is tokenized with tokenizer 'shakespeare'; name a suite for it under eval_suites.runs"),
    (NOTES.replace("  runs: {tiny: notes}\n  default_suite: notes\n", "  default_suite: shakespeare\n"),
     "run 'tiny' (tokenizer 'notes') is "
     "evaluated with suite "
     "'shakespeare' (default_suite), whose bpb set 'shakespeare' is tokenized with tokenizer 'shakespeare'"),
    (NOTES.replace("runs: {tiny: notes}", "runs: {tiny: notes, nano-shakespeare: notes}"),
     "run 'nano-shakespeare' (tokenizer 'shakespeare') is evaluated with suite 'notes' (runs.nano-shakespeare), "
     "whose bpb set 'notes' is tokenized with tokenizer 'notes'"),
    ("eval_suites: {runs: {tiny: nope}}\n", "eval_suites: runs.tiny: 'nope' is not a declared suite"),
    (NOTES.replace("runs: {tiny: notes}", "runs: {tiny: notes, tinny: notes}"),
     "eval_suites.runs.tinny: no run of that name is built here (runs: nano-shakespeare, tiny)"),
    ("sweeps: {s: {mixture: shakespeare}}\n", "sweep 's': field"),
    ("runs: {r: {base: nano-shakespare, seed: 1}}\n",
     "run 'r': field 'base': no entry named 'nano-shakespare' to derive from (known: "),
    ("runs: {a: {base: b}, b: {base: a}}\n", "run 'a': field 'base': bases form a loop: a -> b -> a"),
    ("runs: {r: {base: nano-shakespeare, model: {num_layer: 2}}}\n",
     "run 'r': field 'model.num_layer': unknown field 'num_layer'"),
    ("sweeps: {s: {base: demo, recipe_overrides: {width: [4]}}}\n",
     "sweep 's': field 'recipe_overrides.width': unknown recipe field"),
    ("sweeps: {s: {base: [demo]}}\n", "sweep 's': field 'base': expected the name of another entry, got ['demo']"),
    ("mixture_sweeps: {mix: {run: nano-shakespear, weights: [{shakespeare: 1}]}}\n",
     "mixture sweep 'mix': field 'run': no run named 'nano-shakespear' (runs: "),
    ("mixture_sweeps: {mix: {run: nano-shakespeare, weights: [{shakespeare: 1}, {shakespeare: -1}]}}\n",
     "mixture sweep 'mix': field 'weights[1]': must all be >= 0"),
    ("mixture_sweeps: {mix: {run: nano-shakespeare, weights: [{verse: 1}]}}\n",
     "mixture sweep 'mix': field 'weights': ['verse'] are not components of mixture 'shakespeare'"),
    ("mixture_sweeps: {mix: {run: nano-shakespeare, weights: [{shakespeare: 1}], seed: 1}}\n",
     "mixture sweep 'mix': field 'seed': unknown"),
    ("mixture_sweeps: {mix: {run: nano-shakespeare, weights: [{shakespeare: 1}], fit: {target: [verse]}}}\n",
     "mixture sweep 'mix': field 'fit.target[0]': run 'nano-shakespeare' does not evaluate 'verse' (it evaluates "
     "['shakespeare'])"),
    ("mixture_sweeps: {mix: {run: nano-shakespeare, weights: [{shakespeare: 1}], fit: {top_k: 10, samples: 5}}}\n",
     "mixture sweep 'mix': field 'fit': top_k must be in [1, samples=5], got 10"),
    ("mixture_sweeps: {mix: {run: nano-shakespeare, weights: [{shakespeare: 1}], fit: {interval: 95}}}\n",
     "mixture sweep 'mix': field 'fit': interval must be in (0, 1), got 95"),
    ("runs: {r: {base: nano-shakespeare, mixture_schedule: [{step: 100, weights: {shakespeare: 1}}],\n"
     "           cooldown: {run: nano-shakespeare, step: 299}, optimizer: {warmup: 0}}}\n",
     "run 'r': field 'mixture_schedule': a cooldown trains on its own mixture's weights; schedule the base run "
     "instead"),
    ("runs: {r: {base: nano-shakespeare, mixture_schedule: [{step: 100, weights: {shakespear: 1}}]}}\n",
     "run 'r': field 'mixture_schedule[0].weights': ['shakespear'] are not components of mixture 'shakespeare' "
     "(components: shakespeare)"),
    ("runs: {r: {base: nano-shakespeare, mixture_schedule: [{step: 300, weights: {shakespeare: 1}}]}}\n",
     "run 'r': field 'mixture_schedule[0].step': must lie after the previous stage's step (0) and before "
     "num_train_steps=300, got 300"),
])
def test_a_bad_project_file_is_one_line_naming_the_file_and_the_key(tmp_path, text, problem):
    path = project(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and problem in message and "\n" not in message, message


def test_marin_init_writes_a_starter_that_loads_and_never_replaces_one(tmp_path, monkeypatch, capsys):
    from marin_assets.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MARIN_PROCESS_OUTPUT", "file")  # main() sets it; restored afterwards
    monkeypatch.delenv("MARIN_CONFIG", raising=False)
    monkeypatch.delenv("MARIN_PREFIX", raising=False)
    data = tmp_path / "my texts"
    data.mkdir()
    assert main(["init", "proj", "--data", str(data)]) == 0
    path = tmp_path / "proj" / "marin.yaml"
    text = path.read_text()
    assert text.startswith("# marin.yaml") and f"uri: {data}/**/*.txt" in text
    settings, deployment = load(tmp_path / "proj")
    assert settings.prefix == str(tmp_path / "proj" / "store")
    assert deployment.curation.source("my_text").uri == f"{data}/**/*.txt"
    run = deployment.runs["my-first-run"]
    assert (run.mixture, run.tokenizer) == ("my_text", "my_text") and "my_text" in deployment.tokenization.mixtures
    assert deployment.suites.suite_of_run("my-first-run").bpb == ("my_text",)  # its own held-out text
    assert deployment.suites.suite_of_run("nano-shakespeare").name == "shakespeare"  # the demo's, untouched
    assert main(["init", "proj"]) == 2
    assert path.read_text() == text
    assert "exists; not replacing a project file" in capsys.readouterr().err
    # Without --data the source is texts/ beside the file.
    assert main(["init", "other"]) == 0
    _, other = load(tmp_path / "other")
    assert other.curation.source("my_text").uri == f"{tmp_path}/other/texts/**/*.txt"


def test_the_closing_lines_say_where_the_store_is_and_how_the_ui_finds_the_project(tmp_path, monkeypatch):
    from marin_assets.cli import store_origin, ui_command

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    path = project(tmp_path, "store: store\n")
    monkeypatch.chdir(tmp_path)
    here = MarinSettings.from_env({}, cwd=tmp_path)
    assert store_origin(here) == f"store: in {path}"
    assert ui_command(here) == f"DAGSTER_HOME={tmp_path / 'home'} marin ui"
    monkeypatch.chdir(REPO)  # elsewhere: the command names the file
    assert f"MARIN_CONFIG={path} marin ui" in ui_command(here)
    default = MarinSettings.from_env({}, cwd=REPO)
    assert store_origin(default).startswith("the default, ./local_store")
    assert store_origin(MarinSettings.from_env({"MARIN_PREFIX": "s3://b/p"}, cwd=tmp_path)) == "MARIN_PREFIX"


def test_a_run_plans_only_its_own_mixture_and_tokenizer(tmp_path, monkeypatch):
    """Every run's checkpoint declares every mixture; building one run builds only the data it reads."""
    import dagster as dg

    from marin_assets.definitions import build_definitions
    from marin_assets.planning import Planner, parse_key

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "doc.txt").write_text(f"{name} " * 100)
    project(tmp_path, "\n".join([
        "sources:", "  - {name: a, uri: a/*.txt, format: text}", "  - {name: b, uri: b/*.txt, format: text}",
        "tokenizers: {ta: {train_on: [a]}, tb: {train_on: [b]}}",
        "tokenized: {a: {tokenizer: ta}, b: {tokenizer: tb}}",
        "mixtures: {ma: {tokenizer: ta, components: {a: {}}}, mb: {tokenizer: tb, components: {b: {}}}}",
        f"runs: {{ra: {RUN.replace('notes', 'ma', 1).replace('notes', 'ta')}, "
        f"rb: {RUN.replace('notes', 'mb', 1).replace('notes', 'tb')}}}", ""]))
    # Only these sources: the built-in ones (and their downloads) stay out of this test.
    sources = tmp_path / "only.yaml"
    sources.write_text(f"sources:\n  - {{name: a, uri: {tmp_path}/a/*.txt, format: text}}\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # the embedded default keeps its SQLite files there
    settings = MarinSettings.from_env({"MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(tmp_path / "store")},
                                      cwd=tmp_path)
    defs, catalog = build_definitions(settings)
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        plan = Planner(defs, catalog, defs.resources["store"].get(), instance)
        plan.discover()
        planned = {key.to_user_string() for keys, _ in plan.plan_all([(parse_key("eval"), "ra")]) for key in keys}
    finally:
        instance.dispose()
    assert {"mixture/ma_mixture", "tokenizer/ta_tokenizer", "raw/a_raw", "checkpoint"} <= planned
    assert not [key for key in planned if "/b_" in key or "/mb_" in key or "/tb_" in key], planned


# The project's own suite section, left out: a project file written before eval suites could be declared.
WITHOUT_SUITES = NOTES[:NOTES.index("eval_suites:")] + NOTES[NOTES.index("runs:\n  tiny"):]


@pytest.mark.parametrize("text", [NOTES, WITHOUT_SUITES], ids=["own-suite", "no-suite-declared"])
def test_a_runs_harness_eval_plans_only_its_own_suites_data(tmp_path, monkeypatch, text):
    """With the built-in sources present, evaluating the project's run builds its own chain and no
    other source's (before, it built the Shakespeare and installed_packages chains: 18 runs). A project
    that declares no suite still loads; the built-in default suite, which does not fit its run's
    tokenizer, reads nothing, and the step refuses in one line saying what to declare."""
    import dagster as dg

    from marin_assets.definitions import build_definitions
    from marin_assets.planning import Planner, parse_key
    from marin_assets.training.assets import RUNS

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "doc.txt").write_text("notes " * 100)
    project(tmp_path, text)
    unfit = load(tmp_path)[1].unfit_suites
    assert (unfit == {}) if text == NOTES else ("name a suite for it under eval_suites.runs" in unfit["tiny"])
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store")}, cwd=tmp_path)
    defs, catalog = build_definitions(settings)
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        plan = Planner(defs, catalog, defs.resources["store"].get(), instance)
        # The project's source and the runs only: the built-in sources are never listed (no download).
        plan.discover([name for name in catalog.discoverers if "notes" in name or name == RUNS.name])
        planned = {key.to_user_string() for keys, _ in plan.plan_all([(parse_key("harness_eval"), "tiny")])
                   for key in keys}
        graph = defs.resolve_asset_graph()
    finally:
        instance.dispose()
    own_suite = {"eval_task/notes_line_end_eval_task"} if text == NOTES else set()
    assert {"harness_eval", "checkpoint", "tokenized/notes_tokenized", "raw/notes_raw", "mixture/notes_mixture",
            *own_suite} <= planned, planned
    assert not [key for key in planned if "shakespeare" in key or "installed_packages" in key
                or "quality" in key], planned
    # The harness asset still declares the demo run's suite inputs: that run reads them, this one does not.
    assert parse_key("eval_task/shakespeare_word_order") in graph.get(parse_key("harness_eval")).parent_keys


@pytest.mark.slow  # the CLI, and a code server started from workspace.yaml
def test_the_cli_and_the_code_location_read_the_project_file_of_their_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MARIN_", "DAGSTER_"))}
    env["DAGSTER_HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    path = project(tmp_path, "sources:\n  - {name: notes, uri: texts/*.txt, filters: {min_words: ten}}\n")
    refused = subprocess.run([sys.executable, "-m", "marin_assets.cli", "status"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        f"marin: {path}: source 'notes'.filters.min_words: expected an integer, got 'ten' (str)")

    # As `dagster dev -w workspace.yaml` started in the project directory: its code server finds
    # ./marin.yaml, so the UI shows the project's store and sources with no variable set.
    project(tmp_path, NOTES)
    probe = (
        "import contextlib, sys, dagster as dg\n"
        "from marin_resources.dagster_private import open_workspace\n"
        "with contextlib.ExitStack() as stack:\n"
        "    workspace = open_workspace(stack, dg.DagsterInstance.get(), sys.argv[1])\n"
        "    repo = next(iter(workspace.get_code_location('marin').get_repositories().values()))\n"
        "    store = next(r for r in repo.get_resources() if r.name == 'store')\n"
        "    print('prefix', store.configured_values['prefix'])\n"
        "    print('keys', sorted(k.to_user_string() for k in workspace.asset_graph.get_all_asset_keys()))\n")
    shown = subprocess.run([sys.executable, "-c", probe, str(REPO / "workspace.yaml")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in shown.stdout.splitlines() if line.startswith(("prefix ", "keys ")))
    prefix, keys = lines["prefix"], lines["keys"]  # the code server logs to stdout too
    assert prefix == f'"{tmp_path / "store"}"'
    assert "'raw/notes_raw'" in keys and "'tokenizer/notes_tokenizer'" in keys and "'raw/shakespeare_raw'" in keys


@pytest.mark.slow  # two builds of deduplicated/ through the CLI
def test_a_store_inside_the_data_folder_is_never_read_as_data(tmp_path):
    """Issue 50 (11): `marin init . --data .` puts the store (./store) inside the source's folder. The
    second build read the store's own .txt copies as new data, and the one after failed deduplicated's
    drop_fraction check. Now the second build finds everything fresh."""
    from tests.reliability.test_bad_inputs import prose

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MARIN_", "DAGSTER_"))}
    env.update(DAGSTER_HOME=str(tmp_path / "home"), MARIN_CACHE_DIR=str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"doc_{i:02d}.txt").write_text(prose(7000 + i, 12))

    def marin(*args: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "marin_assets.cli", *args], cwd=data, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(done.stdout) if "--json" in args else {}

    marin("init", ".", "--data", ".")
    first = marin("materialize", "deduplicated/my_text", "--json")
    assert first["success"] and first["prefix"] == str(data / "store")
    second = marin("materialize", "deduplicated/my_text", "--json")
    assert second["success"] and not [s for s in second["steps"] if s["ran"]], second["steps"]
    (listing,) = (data / "store" / "raw" / "my_text").glob("v1-*/*/listing.json")
    assert sorted(item["relpath"] for item in json.loads(listing.read_text())) == \
        [f"doc_{i:02d}.txt" for i in range(12)]
