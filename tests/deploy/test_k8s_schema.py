"""Every Kubernetes object the project renders or sends, against the API server's own schema.

test_k8s_specs.py round-trips our manifests through the ``kubernetes`` client models, which
catches a misspelled key or a mistyped value, but the models are those of the installed client,
newer than the cluster: they take fields a 1.31 API server rejects. Here kubernetes-validate
checks each object against the OpenAPI schema of the Kubernetes version docs/deployment.md
names, strictly (an unknown field is an error, as under ``kubectl apply --validate=strict``):
the builders' manifests, the committed deploy/k8s files, the bodies the launchers really pass
to the (fake) API server, and the run-worker Job that deploy/dagster.yaml's ``K8sRunLauncher``
creates for a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import dagster as dg
import kubernetes
import kubernetes_validate
import pytest
import yaml

from marin_assets.catalog import Catalog
from marin_assets.evaluation.assets import HarnessSuite, RunSuites, build_harness_asset
from marin_assets.evaluation.suites import load_suites
from marin_assets.stages import build_stage
from marin_assets.training.assets import RUNS, build_training_stage, named_run_lookup
from marin_assets.training.spec import load_run_registry
from marin_resources.k8s import (
    CacheVolume,
    CpuRequest,
    GpuRequest,
    TpuRequest,
    build_training_pod_spec,
    render_manifests,
)
from tests.deploy import test_k8s_harness as harness_test
from tests.deploy import test_k8s_launcher as launcher_test
from tests.deploy import test_k8s_training_launcher as training_test
from tests.deploy.test_k8s_specs import make_cfg

KUBERNETES_VERSION = "1.31"
REPO = Path(__file__).resolve().parents[2]
to_dict = kubernetes.client.ApiClient().sanitize_for_serialization


def assert_valid(obj: dict) -> None:
    try:
        schema_version = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(part) for part in exc.absolute_path) or "(top level)"
        # The validator's own message quotes the schema for pages; the path and the reason suffice.
        raise AssertionError(f"{obj['kind']} {obj['metadata'].get('name')}: {where}: {exc.message}") from None
    # kubernetes-validate quietly falls back to the newest schema it has that is not newer than
    # the one asked for; the pin means this exact version.
    assert schema_version == KUBERNETES_VERSION


def test_the_pinned_version_is_the_one_the_deployment_guide_names():
    assert f"Kubernetes {KUBERNETES_VERSION}" in (REPO / "docs" / "deployment.md").read_text()


# ----------------------------------------------------------------------------- builders

SHAPES = {
    "cpu": make_cfg(accelerator=CpuRequest(), cache_volume=CacheVolume(mount_path="/cache", size_limit="100Gi")),
    "8xH100": make_cfg(accelerator=GpuRequest(count=8, gpu_type="nvidia-h100-80gb"),
                       cache_volume=CacheVolume(mount_path="/cache", claim_name="marin-cache")),
    "v5litepod-4": make_cfg(accelerator=TpuRequest(tpu_type="v5litepod-4", topology="2x2", hosts=1)),
    "v5litepod-16": make_cfg(accelerator=TpuRequest(tpu_type="v5litepod-16", topology="4x4", hosts=4)),
}


@pytest.mark.parametrize("obj", [pytest.param(obj, id=f"{shape}-{obj['kind']}")
                                 for shape, cfg in SHAPES.items() for obj in render_manifests(cfg)])
def test_rendered_manifests_match_the_schema(obj):
    assert_valid(obj)


@pytest.mark.parametrize("obj", [pytest.param(obj, id=f"{path.name}-{obj['kind']}")
                                 for path in sorted((REPO / "deploy" / "k8s").glob("*.yaml"))
                                 for obj in yaml.safe_load_all(path.read_text())])
def test_committed_manifests_match_the_schema(obj):
    assert_valid(obj)


@pytest.mark.parametrize(
    "break_it, message",
    [
        pytest.param(lambda pod: pod["spec"]["containers"][0].update(comand=["train"]), "'comand' was unexpected",
                     id="unknown-field"),
        pytest.param(lambda pod: pod["spec"].update(activeDeadlineSeconds="7d"), "'7d' is not of type 'integer'",
                     id="wrong-type"),
        pytest.param(lambda pod: pod["spec"]["containers"][0].pop("name"), "'name' is a required property",
                     id="missing-required-field"),
        # Container stop signals arrived in Kubernetes 1.33; the client models already have them.
        pytest.param(lambda pod: pod["spec"]["containers"][0].update(lifecycle={"stopSignal": "SIGINT"}),
                     "'stopSignal' was unexpected", id="field-newer-than-the-pinned-version"),
    ],
)
def test_the_check_rejects_what_the_api_server_would(break_it, message):
    pod = build_training_pod_spec(SHAPES["cpu"])
    assert_valid(pod)
    break_it(pod)
    with pytest.raises(AssertionError, match=message):
        assert_valid(pod)


# ----------------------------------------------------------------------------- what the launchers send

# Create calls on the fake API server and the type each one's endpoint stands for: the API
# server takes apiVersion and kind from the endpoint when the body leaves them out, as
# PipesK8sClient's pods do.
ENDPOINTS = {
    "create_namespaced_pod": {"apiVersion": "v1", "kind": "Pod"},
    "create_namespaced_service": {"apiVersion": "v1", "kind": "Service"},
    "create_namespaced_job": {"apiVersion": "batch/v1", "kind": "Job"},
}


@pytest.fixture
def sent(cluster, monkeypatch) -> list[dict]:
    """Every body passed to the fake API server, serialized as the client puts it on the wire."""
    bodies: list[dict] = []
    for method, endpoint_type in ENDPOINTS.items():
        def record(namespace, body, create=getattr(cluster, method), endpoint_type=endpoint_type):  # noqa: B008 - binds this endpoint's method
            bodies.append({**endpoint_type, **to_dict(body)})
            return create(namespace, body)

        monkeypatch.setattr(cluster, method, record)
    return bodies


def pipes_launch(accelerator):
    """K8sPipesLauncher.run from an asset: PipesK8sClient's pod, or our Service + Indexed Job."""
    def launch(tmp_path, cluster, synthetic_deployment):
        return launcher_test.materialize_with(accelerator, [sys.executable, "-c", launcher_test.CHILD])
    return launch


def checkpoint(run: str, pool: str):
    """The `checkpoint` asset with the prod K8sTrainingLauncher, for one run of test_k8s_training_launcher.RUNS."""
    def launch(tmp_path, cluster, synthetic_deployment):
        settings, resources = training_test.make_deployment(tmp_path, cluster, str(tmp_path / "store"),
                                                            store_claim="marin-store")
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions(RUNS.name, [run])
            result, _ = training_test.materialize_checkpoint((settings, resources, instance), run, pool, cluster,
                                                             synthetic_deployment)
        return result
    return launch


def harness_eval(tmp_path, cluster, synthetic_deployment):
    """The `harness_eval` asset with the prod K8sTrainingLauncher, placed like the 8xH100 run."""
    settings, resources = training_test.make_deployment(tmp_path, cluster, str(tmp_path / "store"),
                                                        store_claim="marin-store")
    cluster.programs["marin_assets.evaluation.harness_main"] = [sys.executable, harness_test.FAKE_HARNESS_MAIN]
    deployment = synthetic_deployment(runs=load_run_registry(settings.runs_file))
    harness_test.commit_checkpoint(resources["store"].get(), dict(deployment.runs)[harness_test.RUN])
    registry = load_suites()
    asset, _ = build_harness_asset(RunSuites.single(HarnessSuite.resolve(registry, registry.suite("core"), set(), {})),
                                   key="harness_eval", partitions=RUNS, heldout={},
                                   checkpoint=build_stage(build_training_stage, settings, deployment)[1].spec(
                                       "checkpoint"),
                                   spec_for=named_run_lookup(settings, deployment), pool="gpu",
                                   group_name="evaluation", catalog=Catalog())
    training, _ = build_stage(build_training_stage, settings, deployment)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(RUNS.name, [harness_test.RUN])
        return dg.materialize([*training.assets, asset], partition_key=harness_test.RUN, instance=instance,
                              resources=resources, selection=[asset.key], raise_on_error=False)


@pytest.mark.parametrize(
    "launch, kinds",
    [
        pytest.param(pipes_launch(GpuRequest(count=8, gpu_type="nvidia-h100-80gb")), ["Pod"],
                     id="K8sPipesLauncher-8xH100-Pod"),
        pytest.param(pipes_launch(TpuRequest(tpu_type="v5litepod-16", topology="4x4", hosts=4)), ["Service", "Job"],
                     id="K8sPipesLauncher-v5litepod-16-Service+Job"),
        pytest.param(checkpoint("h100x8", "gpu"), ["Pod"], id="checkpoint-8xH100-Pod"),
        pytest.param(checkpoint("v5e16", "tpu"), ["Service", "Job"], id="checkpoint-v5litepod-16-Service+Job"),
        pytest.param(harness_eval, ["Pod"], id="harness_eval-8xH100-Pod"),
    ],
)
def test_objects_sent_to_the_api_server_match_the_schema(launch, kinds, sent, tmp_path, cluster,
                                                         synthetic_deployment):
    result = launch(tmp_path, cluster, synthetic_deployment)
    assert result.success, [str(e.event_specific_data.error) for e in result.all_events if e.is_step_failure]
    assert [obj["kind"] for obj in sent] == kinds
    for obj in sent:
        assert_valid(obj)


def test_the_run_worker_job_from_deploy_dagster_yaml_matches_the_schema(monkeypatch):
    """deploy/dagster.yaml's run launcher section, on a throwaway instance, launches one run; the
    Job it creates is caught at the client call that would send it."""
    from marin_resources.dagster_private import launch_run_context, python_job_origin

    run_launcher = yaml.safe_load((REPO / "deploy" / "dagster.yaml").read_text())["run_launcher"]
    for name in ("MARIN_K8S_JOB_NAMESPACE", "MARIN_INSTANCE_CONFIGMAP", *run_launcher["config"]["env_vars"]):
        monkeypatch.setenv(name, f"value-of-{name}".lower().replace("_", "-"))
    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    created = []
    monkeypatch.setattr(kubernetes.client.BatchV1Api, "create_namespaced_job",
                        lambda self, namespace, body, **_: created.append(to_dict(body)))

    @dg.asset
    def tokenized():
        return None

    job = dg.Definitions(assets=[tokenized]).resolve_implicit_global_asset_job_def()
    origin = python_job_origin(job.name, "/opt/venv/bin/python", "marin_assets.definitions", "defs", "/app",
                               "us-docker.pkg.dev/p/marin/marin-dagster:abc")
    with dg.instance_for_test(overrides={"run_launcher": run_launcher}) as instance:
        run = instance.create_run_for_job(job, job_code_origin=origin)
        instance.run_launcher.launch_run(launch_run_context(run))

    [run_worker] = created
    assert run_worker["kind"] == "Job"
    assert_valid(run_worker)
