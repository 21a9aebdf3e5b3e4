"""Retry policies where the docs promise them (issue 50, finding 12): deploy/dagster.yaml retries a
run only when its worker died and says the assets carry their own retry policies, but none did.
The training assets (`checkpoint`, each sweep's `sweep_checkpoint/<sweep>`) now retry once, a
minute later, resuming from their latest checkpoint; a refusal is never retried; and a failure
after the retries is reported as the last attempt's error, not as Dagster's "Exceeded max_retries"."""

import dagster as dg

from marin_assets.definitions import build_definitions
from marin_assets.training.assets import TRAINING_RETRY, termination_is_final
from marin_resources.artifacts import input_refused
from marin_resources.environments import MarinSettings
from marin_resources.failures import failed_materializations
from marin_resources.keys import marin_key

INSTANT_RETRY = dg.RetryPolicy(max_retries=1)


def test_the_training_assets_carry_their_retry_policy_and_no_other_asset_does():
    defs, _ = build_definitions(MarinSettings.from_env({}))
    policies = {marin_key(key): assets.op.retry_policy for assets in defs.resolve_asset_graph().assets_defs
                if assets.is_executable for key in assets.keys}
    training = {key for key in policies if key == "checkpoint" or key.startswith("sweep_checkpoint/")}
    assert training >= {"checkpoint", "sweep_checkpoint/demo"}, sorted(policies)
    assert {key: policies[key] for key in training} == dict.fromkeys(training, TRAINING_RETRY)
    assert TRAINING_RETRY.max_retries == 1 and TRAINING_RETRY.delay == 60
    assert {key: p for key, p in policies.items() if key not in training and p is not None} == {}


def test_a_refusal_is_not_retried_and_a_retried_failure_is_told_by_its_own_error():
    attempts = {"refused": 0, "crashed": 0}

    @dg.asset(retry_policy=INSTANT_RETRY)
    def refused():
        attempts["refused"] += 1
        raise input_refused("checkpoint[x]: no run named 'x'")

    @dg.asset(retry_policy=INSTANT_RETRY)
    def crashed():
        attempts["crashed"] += 1
        raise RuntimeError(f"pod lost (attempt {attempts['crashed']})")

    with dg.instance_for_test() as instance:
        for asset in (refused, crashed):
            assert not dg.materialize([asset], instance=instance, raise_on_error=False).success
        errors = {row["failed_assets"][0]: row["error"] for row in failed_materializations(instance)}
    assert attempts == {"refused": 1, "crashed": 2}
    assert errors == {"refused": "Failure: checkpoint[x]: no run named 'x'",
                      "crashed": "RuntimeError: pod lost (attempt 2)"}, errors


def test_a_terminated_training_step_is_not_retried_but_an_interrupt_nobody_asked_for_is():
    """Under a retry policy Dagster retries a step it interrupts: after the UI's Terminate, the training would
    start again a minute later. `termination_is_final` (on `checkpoint`) ends it for good when its run is
    being canceled, and the run ends canceled; another interrupt (a preempted run worker) is retried."""
    attempts = {"terminated": 0, "interrupted": 0}

    @dg.asset(retry_policy=INSTANT_RETRY)
    @termination_is_final
    def terminated(context: dg.AssetExecutionContext):
        attempts["terminated"] += 1
        context.instance.report_run_canceling(context.instance.get_run_by_id(context.run_id))  # Terminate
        raise dg.DagsterExecutionInterruptedError()

    @dg.asset(retry_policy=INSTANT_RETRY)
    @termination_is_final
    def interrupted(context: dg.AssetExecutionContext):
        attempts["interrupted"] += 1
        if attempts["interrupted"] == 1:
            raise dg.DagsterExecutionInterruptedError()

    with dg.instance_for_test() as instance:
        canceled = dg.materialize([terminated], instance=instance, raise_on_error=False)
        retried = dg.materialize([interrupted], instance=instance, raise_on_error=False)
        assert instance.get_run_by_id(canceled.run_id).status == dg.DagsterRunStatus.CANCELED
    assert attempts == {"terminated": 1, "interrupted": 2} and retried.success
