"""The Helm values, the hand-written instance and the Dockerfile describe the same deployment.

The Helm chart renders its own dagster.yaml from values.yaml; deploy/dagster.yaml is the same
instance for non-Helm use. These tests keep the two from drifting and check the values against
the key names of the official chart's schema (helm/dagster/schema in dagster-io/dagster).
"""

import re
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VALUES = yaml.safe_load((REPO / "deploy/helm/values.yaml").read_text())
OAUTH2_PROXY = yaml.safe_load((REPO / "deploy/helm/oauth2-proxy-values.yaml").read_text())
INSTANCE = yaml.safe_load((REPO / "deploy/dagster.yaml").read_text())
DOCKERFILE = (REPO / "deploy/Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# Top-level and per-deployment keys of the dagster/dagster chart (values schema, 1.13 line).
CHART_TOP_LEVEL = {
    "global", "dagsterWebserver", "dagster-user-deployments", "postgresql",
    "generatePostgresqlPasswordSecret", "generateCeleryConfigSecret", "rabbitmq", "redis",
    "flower", "ingress", "imagePullSecrets", "computeLogManager", "scheduler", "runLauncher",
    "pythonLogs", "dagsterDaemon", "busybox", "migrate", "telemetry", "serviceAccount",
    "retention", "additionalInstanceConfig", "concurrency", "defsStateStorage",
}  # fmt: skip
CHART_USER_DEPLOYMENT = {
    "name", "image", "port", "dagsterApiGrpcArgs", "codeServerArgs",
    "includeConfigInLaunchedRuns", "env", "envConfigMaps", "envSecrets", "annotations",
    "nodeSelector", "affinity", "tolerations", "podSecurityContext", "securityContext",
    "resources", "livenessProbe", "readinessProbe", "startupProbe", "labels", "volumeMounts",
    "volumes", "schedulerName",
}  # fmt: skip
CHART_WEBSERVER = {
    "replicaCount", "image", "nameOverride", "pathPrefix", "service", "workspace", "env", "envConfigMaps",
    "envSecrets", "deploymentLabels", "labels", "nodeSelector", "affinity", "tolerations",
    "podSecurityContext", "securityContext", "resources", "readinessProbe", "livenessProbe", "startupProbe",
    "annotations", "enableReadOnly", "dbStatementTimeout", "dbPoolRecycle", "logLevel", "volumeMounts",
    "volumes", "schedulerName",
}  # fmt: skip
CHART_K8S_RUN_LAUNCHER = {
    "image", "imagePullPolicy", "jobNamespace", "loadInclusterConfig", "kubeconfigFile",
    "envConfigMaps", "envSecrets", "envVars", "volumeMounts", "volumes", "labels",
    "failPodOnRunFailure", "resources", "schedulerName", "securityContext", "runK8sConfig",
}  # fmt: skip


def test_values_use_only_chart_keys():
    assert set(VALUES) <= CHART_TOP_LEVEL
    [deployment] = VALUES["dagster-user-deployments"]["deployments"]
    assert set(deployment) <= CHART_USER_DEPLOYMENT
    assert VALUES["runLauncher"]["type"] == "K8sRunLauncher"
    assert set(VALUES["runLauncher"]["config"]["k8sRunLauncher"]) <= CHART_K8S_RUN_LAUNCHER
    assert set(VALUES["dagsterWebserver"]) <= CHART_WEBSERVER
    assert set(VALUES["concurrency"]) <= {"enabled", "pools", "runs"}
    assert set(VALUES["concurrency"]["pools"]) <= {
        "defaultLimit",
        "granularity",
        "opGranularityRunBuffer",
    }
    assert set(VALUES["concurrency"]["runs"]) <= {"maxConcurrentRuns", "tagConcurrencyLimits"}
    # The chart refuses a run limit in both the concurrency block and the run coordinator.
    queued = VALUES["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]
    assert "maxConcurrentRuns" not in queued and "tagConcurrencyLimits" not in queued


def test_code_location_module_is_the_projects():
    module = PYPROJECT["tool"]["dagster"]["module_name"]
    assert (REPO / (module.replace(".", "/") + ".py")).is_file()
    [deployment] = VALUES["dagster-user-deployments"]["deployments"]
    assert deployment["dagsterApiGrpcArgs"] == ["-m", module]
    cmd = re.search(r"^CMD (\[.*\])$", DOCKERFILE, re.M)
    assert cmd and yaml.safe_load(cmd.group(1)) == [
        "dagster", "api", "grpc", "-m", module, "-h", "0.0.0.0", "-p", str(deployment["port"]),
    ]  # fmt: skip


def test_helm_and_instance_yaml_agree():
    runs, pools = INSTANCE["concurrency"]["runs"], INSTANCE["concurrency"]["pools"]
    assert VALUES["concurrency"]["enabled"] is True
    assert VALUES["concurrency"]["runs"]["maxConcurrentRuns"] == runs["max_concurrent_runs"]
    assert VALUES["concurrency"]["runs"]["tagConcurrencyLimits"] == runs["tag_concurrency_limits"]
    assert VALUES["concurrency"]["pools"]["defaultLimit"] == pools["default_limit"]
    assert VALUES["concurrency"]["pools"]["granularity"] == pools["granularity"]
    assert INSTANCE["run_coordinator"]["class"] == VALUES["dagsterDaemon"]["runCoordinator"]["type"]

    launcher = INSTANCE["run_launcher"]["config"]
    helm_launcher = VALUES["runLauncher"]["config"]["k8sRunLauncher"]
    assert INSTANCE["run_launcher"]["class"] == VALUES["runLauncher"]["type"]
    assert launcher["postgres_password_secret"] == VALUES["global"]["postgresqlSecretName"]
    assert (
        launcher["service_account_name"]
        == (helm_launcher["runK8sConfig"]["podSpecConfig"]["serviceAccountName"])
    )
    assert launcher["fail_pod_on_run_failure"] == helm_launcher["failPodOnRunFailure"]
    assert launcher["resources"] == helm_launcher["resources"]

    monitoring, helm_monitoring = (
        INSTANCE["run_monitoring"],
        VALUES["dagsterDaemon"]["runMonitoring"],
    )
    assert monitoring["start_timeout_seconds"] == helm_monitoring["startTimeoutSeconds"]
    assert monitoring["poll_interval_seconds"] == helm_monitoring["pollIntervalSeconds"]
    retries, helm_retries = INSTANCE["run_retries"], VALUES["dagsterDaemon"]["runRetries"]
    assert retries["max_retries"] == helm_retries["maxRetries"]
    assert retries["retry_on_asset_or_op_failure"] == helm_retries["retryOnAssetOrOpFailure"]

    assert (
        INSTANCE["storage"]["postgres"]["postgres_db"]["scheme"]
        == VALUES["postgresql"]["postgresqlScheme"]
    )
    assert INSTANCE["compute_logs"]["class"] == VALUES["computeLogManager"]["type"]
    assert (
        INSTANCE["compute_logs"]["config"]["prefix"]
        == (VALUES["computeLogManager"]["config"]["gcsComputeLogManager"]["prefix"])
    )
    assert INSTANCE["telemetry"]["enabled"] is VALUES["telemetry"]["enabled"] is False


def test_database_password_is_only_ever_referenced():
    assert VALUES["generatePostgresqlPasswordSecret"] is False
    assert VALUES["postgresql"]["enabled"] is False
    assert VALUES["postgresql"]["postgresqlPassword"] == ""
    password = INSTANCE["storage"]["postgres"]["postgres_db"]["password"]
    assert password == {"env": "DAGSTER_PG_PASSWORD"}
    # Every other connection field is env-sourced too, so the file is site independent.
    db = INSTANCE["storage"]["postgres"]["postgres_db"]
    assert {k: v for k, v in db.items() if k != "scheme"} == {
        "hostname": {"env": "DAGSTER_PG_HOST"},
        "port": {"env": "DAGSTER_PG_PORT"},
        "username": {"env": "DAGSTER_PG_USER"},
        "password": {"env": "DAGSTER_PG_PASSWORD"},
        "db_name": {"env": "DAGSTER_PG_DB"},
    }


def test_training_env_reaches_run_workers():
    [deployment] = VALUES["dagster-user-deployments"]["deployments"]
    assert deployment["includeConfigInLaunchedRuns"]["enabled"] is True
    forwarded = set(INSTANCE["run_launcher"]["config"]["env_vars"])
    assert {"MARIN_TRAINING_IMAGE", "MARIN_TRAINING_NAMESPACE", "MARIN_GPU_TYPE"} <= set(
        deployment["env"]
    ) & forwarded


def dockerfile_copy_sources() -> list[str]:
    sources = []
    for line in DOCKERFILE.splitlines():
        if line.startswith("COPY "):
            parts = [p for p in line.split()[1:] if not p.startswith("--")]
            sources += parts[:-1]
    return sources


def test_dockerfile_builds_from_the_lock():
    assert re.search(r"^FROM python:3\.11-slim$", DOCKERFILE, re.M)
    syncs = re.findall(r"uv sync ([^\n\\]*)", DOCKERFILE)
    assert syncs and all("--frozen" in s and "--no-dev" in s for s in syncs)
    # The accelerator plugin is installed between the syncs; the last sync must not remove it.
    assert "--inexact" in syncs[-1]
    assert re.search(r"^ENV .*DAGSTER_HOME=", DOCKERFILE, re.M | re.S)
    assert "EXPOSE 4000" in DOCKERFILE


@pytest.mark.parametrize("source", dockerfile_copy_sources())
def test_dockerfile_copies_files_that_exist(source):
    assert (REPO / source).exists(), f"deploy/Dockerfile copies missing {source}"


def test_no_unauthenticated_path_reaches_the_writable_web_ui_by_default():
    """Issue #30: the UI launches runs with the deployment's credentials, and the values said nothing
    about who may reach it. The chart exposes the webserver through its Service (its type) and its
    Ingress (one set of annotations for the writable and read-only webservers alike, helm/dagster
    templates/ingress.yaml); the only other way in is oauth2-proxy's Ingress, which authenticates
    every request before passing it to the webserver's Service."""
    web = VALUES["dagsterWebserver"]
    assert web["service"]["type"] == "ClusterIP"  # no LoadBalancer or NodePort
    chart_ingress = VALUES.get("ingress", {})
    assert not chart_ingress.get("enabled") or \
        "nginx.ingress.kubernetes.io/auth-url" in chart_ingress.get("annotations", {})

    proxy = tomllib.loads(OAUTH2_PROXY["config"]["configFile"])
    # `dagster.webserver.fullname`: the release name (docs/deployment.md installs `dagster`) + "-webserver".
    assert proxy["upstreams"] == [f"http://dagster-webserver:{web['service']['port']}/"]
    assert not [key for key in proxy if key.startswith("skip_auth")], proxy
    assert "*" not in proxy["email_domains"] and proxy["cookie_secure"] is True
    # Issue 50, finding 9: a page on another site that POSTs to the UI sends no session cookie, so the
    # proxy refuses it ("strict" would also drop the cookie on the identity provider's redirect back).
    assert proxy.get("cookie_samesite") == "lax" and proxy.get("cookie_httponly", True) is True
    assert OAUTH2_PROXY["ingress"]["enabled"] and OAUTH2_PROXY["service"]["type"] == "ClusterIP"
    # The OAuth client and cookie secrets by reference only.
    assert OAUTH2_PROXY["config"]["existingSecret"]
    assert not {"clientID", "clientSecret", "cookieSecret"} & set(OAUTH2_PROXY["config"])
    deployment = (REPO / "docs" / "deployment.md").read_text()
    assert "launches runs with the deployment's credentials" in deployment and "--read-only" in deployment
