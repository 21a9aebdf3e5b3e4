"""The planner runs a step as soon as the steps it reads from have succeeded: a long partition of one
stage does not hold back a later stage's step that does not read it, and a failed step skips only
the steps that read it."""

import uuid

import dagster as dg
import pytest

from marin_assets.catalog import Catalog
from marin_assets.planning import Planner, parse_key
from marin_assets.run_submission import InProcessRuns
from marin_resources.keys import asset_key
from marin_resources.storage.store import ArtifactStore

SHARDS = dg.StaticPartitionsDefinition(["broken", "fast", "slow"])
# Its own partitions definition, so that it is a step of its own, not one run with test/fast_only.
WHOLE = dg.StaticPartitionsDefinition(["whole"])


class HeldBackRuns:
    """In-process runs, except that the run of partition ``held`` finishes only once ``until`` has
    been submitted and built: a planner that waited for every partition of a stage would wait on it
    forever (the test's timeout)."""

    max_parallel = 8

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance, held: str, until: dg.AssetKey):
        self.inner, self.instance, self.held, self.until = InProcessRuns(defs, instance), instance, held, until
        self.waiting: tuple | None = None
        self.order: list[str] = []

    def submit(self, keys, checks, partition, run_config, tags) -> str:
        if partition == self.held and not any(self.until.path[-1] in run for run in self.order):
            placeholder = uuid.uuid4().hex
            self.instance.add_run(dg.DagsterRun(job_name="held_back", run_id=placeholder,
                                                status=dg.DagsterRunStatus.STARTED))
            self.waiting = (placeholder, keys, checks, partition, run_config, tags)
            return placeholder
        run_id = self.run(keys, checks, partition, run_config, tags)
        if self.until in keys and self.waiting is not None:
            placeholder, *request = self.waiting
            status = self.instance.get_run_by_id(self.run(*request)).status
            self.instance.delete_run(placeholder)
            self.instance.add_run(dg.DagsterRun(job_name="held_back", run_id=placeholder, status=status))
        return run_id

    def no_more_runs(self) -> None:
        self.order.append("no more runs")

    def run(self, keys, checks, partition, run_config, tags) -> str:
        self.order.append("+".join(k.path[-1] for k in keys) + (f"[{partition}]" if partition else ""))
        return self.inner.submit(keys, checks, partition, run_config, tags)


def three_assets() -> dg.Definitions:
    """test/shard (three partitions; "broken" fails), test/fast_only (reads shard "fast") and
    test/every_shard (reads every shard)."""

    @dg.asset(key=asset_key("test/shard"), partitions_def=SHARDS)
    def shard(context: dg.AssetExecutionContext) -> None:
        if context.partition_key == "broken":
            raise ValueError("this shard cannot be read")

    @dg.asset(key=asset_key("test/fast_only"), deps=[dg.AssetDep(
        shard, partition_mapping=dg.SpecificPartitionsPartitionMapping(["fast"]))])
    def fast_only() -> None: ...

    @dg.asset(key=asset_key("test/every_shard"), partitions_def=WHOLE,
              deps=[dg.AssetDep(shard, partition_mapping=dg.AllPartitionMapping())])
    def every_shard() -> None: ...

    return dg.Definitions(assets=[shard, fast_only, every_shard])


@pytest.mark.timeout(30)
def test_a_step_starts_when_its_own_inputs_are_done_and_a_failure_skips_only_its_readers(tmp_path):
    defs = three_assets()
    log: list[str] = []
    with dg.instance_for_test() as instance:
        planner = Planner(defs, Catalog(), ArtifactStore(str(tmp_path)), instance)
        runs = HeldBackRuns(defs, instance, held="slow", until=asset_key("test/fast_only"))
        steps = planner.materialize_all([(parse_key("test/fast_only"), None), (parse_key("test/every_shard"), None),
                                         (parse_key("test/shard"), "slow")], log=log.append, runs=runs, max_parallel=4)

    outcome = {(tuple(s.asset_keys), s.partition): (s.ran, s.success, s.skipped) for s in steps}
    assert outcome == {
        (("test/shard",), "broken"): (True, False, False),
        (("test/shard",), "fast"): (True, True, False),
        (("test/shard",), "slow"): (True, True, False),
        (("test/fast_only",), None): (True, True, False),
        (("test/every_shard",), "whole"): (False, False, True),  # reads the broken shard
    }, log
    # The slow shard ran last: test/fast_only did not wait for it. It reads only the fast shard, so it
    # joined that shard's run.
    assert runs.order == ["shard_test+fast_only_test[fast]", "shard_test[broken]", "shard_test[slow]"]
    assert ("          with test/fast_only in the same run (it reads it, and nothing else it reads is left to "
            "build)") in log
    assert "  skip    test/every_shard [whole]  (input test/shard [broken] did not succeed)" in log


@pytest.mark.timeout(30)
@pytest.mark.parametrize("last_plan", [True, False])
def test_the_submitter_hears_before_the_last_run_of_the_last_plan_that_no_more_come(tmp_path, last_plan):
    """So the code server warms no run worker for a run that never comes (`WarmRunWorkers`)."""
    defs = three_assets()
    with dg.instance_for_test() as instance:
        planner = Planner(defs, Catalog(), ArtifactStore(str(tmp_path)), instance)
        runs = HeldBackRuns(defs, instance, held="none", until=asset_key("test/none"))
        steps = planner.materialize_all([(parse_key("test/shard"), "fast"), (parse_key("test/shard"), "slow")],
                                        log=lambda _: None, runs=runs, max_parallel=1, last_plan=last_plan)
    assert all(s.success for s in steps)
    told = ["no more runs"] if last_plan else []
    assert runs.order == ["shard_test[fast]", *told, "shard_test[slow]"]


def test_the_plan_of_several_targets_is_one_plan_whose_steps_name_what_they_read(tmp_path):
    defs = three_assets()
    with dg.instance_for_test() as instance:
        planner = Planner(defs, Catalog(), ArtifactStore(str(tmp_path)), instance)
        alone = planner.steps_of([(parse_key("test/fast_only"), None)])
        both = planner.steps_of([(parse_key("test/fast_only"), None), (parse_key("test/every_shard"), None)])
        with pytest.raises(ValueError, match="not partitioned"):
            planner.steps_of([(parse_key("test/fast_only"), "fast")])

    def named(steps):
        return {(s.keys[0].path[-1], s.partition): {(steps[i].keys[0].path[-1], steps[i].partition) for i in s.after}
                for s in steps}

    assert named(alone) == {("shard_test", "fast"): set(), ("fast_only_test", None): {("shard_test", "fast")}}
    assert named(both) == {
        ("shard_test", "broken"): set(), ("shard_test", "fast"): set(), ("shard_test", "slow"): set(),
        ("fast_only_test", None): {("shard_test", "fast")},
        ("every_shard_test", "whole"): {("shard_test", p) for p in ("broken", "fast", "slow")},
    }
    # Steps start in the order of the targets they serve: the first target's inputs first.
    assert {(s.keys[0].path[-1], s.partition): s.serves for s in both} == {
        ("shard_test", "fast"): 0, ("fast_only_test", None): 0,
        ("shard_test", "broken"): 1, ("shard_test", "slow"): 1, ("every_shard_test", "whole"): 1}


def leader_and_follower(*, follower_fails: bool = False, check_raises: bool = False) -> dg.Definitions:
    """test/one (partition "a") and test/after_one, unpartitioned, which reads only that partition."""
    one_part = dg.StaticPartitionsDefinition(["a"])

    @dg.asset(key=asset_key("test/one"), partitions_def=one_part)
    def one() -> None: ...

    @dg.asset_check(asset=one, partitions_def=one_part)
    def one_is_readable() -> dg.AssetCheckResult:
        if check_raises:
            raise RuntimeError("the check could not read the shard")
        return dg.AssetCheckResult(passed=True)

    @dg.asset(key=asset_key("test/after_one"), deps=[one])
    def after_one() -> None:
        if follower_fails:
            raise ValueError("the global step failed")

    return dg.Definitions(assets=[one, after_one], asset_checks=[one_is_readable])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("follower_fails, check_raises, expected", [
    (False, False, {"a": (True, False), None: (True, False)}),
    (True, False, {"a": (True, False), None: (False, False)}),   # the shard stands; the global step failed
    (False, True, {"a": (False, False), None: (False, True)}),   # a raising check fails the shard
])
def test_a_global_step_joins_the_run_of_the_one_shard_it_waits_for(tmp_path, follower_fails, check_raises, expected):
    defs = leader_and_follower(follower_fails=follower_fails, check_raises=check_raises)
    log: list[str] = []
    with dg.instance_for_test() as instance:
        planner = Planner(defs, Catalog(), ArtifactStore(str(tmp_path)), instance)
        steps = planner.materialize_all([(parse_key("test/after_one"), None)], log=log.append)
    assert {s.partition: (s.success, s.skipped) for s in steps} == expected, log
    ran = [s for s in steps if s.ran]
    assert len({s.run_id for s in ran}) == 1, log
    assert any("with test/after_one in the same run" in line for line in log)
