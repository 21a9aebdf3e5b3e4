"""Dagster's own staleness (what the UI shows as "Unsynced", from the instance's data versions)
agrees with `marin status` on every asset partition: when everything is built, after a source
file changes (observed as the source asset's new data version), and after the changed shard's
raw bytes are rebuilt (its documents become stale in both). `marin status` also marks everything
downstream of a stale input stale ("upstream X is stale"); Dagster's status does not propagate, so
those are compared by their own inputs: fresh in both."""

import pytest

from marin_assets.run_submission import InProcessRuns
from marin_resources.dagster_private import stale_status_reader
from marin_resources.keys import asset_key

BODIES = {
    "alpha": "The harbour master counted the boats at dawn and wrote each name in a heavy green ledger. "
             "Gulls argued over the nets while the tide turned slowly against the stone wall of the pier. ",
    "bravo": "In the mountain village the school bell rang twice, and the children climbed the steep path "
             "with their satchels, stopping to watch a hawk circle above the pine trees near the old mill. ",
}
DOWNSTREAM_OF_DOCUMENTS = {("filtered/letters", "bravo.txt"), ("dedup_index/letters", None),
                           ("deduplicated/letters", None)}


def both_states(plan) -> dict[tuple[str, str | None], tuple[str, str, str]]:
    """(asset, partition) -> (marin status, marin status from its own inputs only, Dagster's stale
    status) for every artifact partition."""
    dagster_status = stale_status_reader(plan.instance, plan.graph)
    out = {}
    for state in plan.status():
        key = asset_key(state.asset_key)
        own = "fresh" if state.decision.kind == "upstream" else state.state
        out[(state.asset_key, state.partition)] = (state.state, own, dagster_status(key, state.partition))
    return out


def assert_agree(plan, expected_stale: set[tuple[str, str | None]], propagated=frozenset()) -> None:
    """`expected_stale`: not fresh by their own inputs; `propagated`: stale only because an input is."""
    states = both_states(plan)
    disagree = {k: v for k, v in states.items() if v[1] != v[2]}
    assert not disagree, f"marin status vs Dagster: {disagree}"
    assert {k for k, (_, own, _) in states.items() if own != "fresh"} == expected_stale, states
    assert {k for k, (marin, own, _) in states.items() if marin != own} == set(propagated), states


@pytest.fixture
def letters(curation_planner, tmp_path):
    data = tmp_path / "letters"
    data.mkdir()
    for word, body in BODIES.items():
        (data / f"{word}.txt").write_text(f"Letter {word}. " + body * 6)
    plan = curation_planner(f"sources:\n  - name: letters\n    uri: {data}/*.txt\n    format: text\n"
                            "    files_per_shard: 1\n")
    return plan, data


@pytest.mark.slow  # three builds of the curation stage
def test_dagster_staleness_agrees_with_marin_status(letters):
    plan, data = letters
    runs = InProcessRuns(plan.defs, plan.instance)
    plan.discover()
    target = asset_key("deduplicated/letters")
    assert all(s.success for s in plan.materialize(target, None, log=lambda m: None, runs=runs))
    assert_agree(plan, set())

    # A source file changes: the source asset's new observation makes its raw shard stale in both.
    bravo = data / "bravo.txt"
    bravo.write_text(bravo.read_text() + "A postscript arrived with the evening post. ")
    from marin_assets.curation import assets as curation
    curation._listings.clear()  # the listing memo is for one CLI pass; this test is several
    plan.discover()
    assert_agree(plan, {("raw/letters", "bravo.txt")}, DOWNSTREAM_OF_DOCUMENTS | {("documents/letters", "bravo.txt")})
    assert plan.observe_sources() == 0  # an unchanged listing records nothing new

    # Only the raw shard rebuilt: its documents are stale in both, the other shard untouched.
    assert all(s.success for s in plan.materialize(asset_key("raw/letters"), "bravo.txt", log=lambda m: None,
                                                   runs=runs))
    assert_agree(plan, {("documents/letters", "bravo.txt")}, DOWNSTREAM_OF_DOCUMENTS)

    assert all(s.success for s in plan.materialize(target, None, log=lambda m: None, runs=runs))
    assert_agree(plan, set())
