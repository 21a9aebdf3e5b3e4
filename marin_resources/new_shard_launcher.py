"""`NewShardRunLauncher`: the instance's run launcher that sends the new-shard flow's per-shard runs to
a running Ray cluster and every other run to the launcher it wraps (docs/scaling-out.md, "New shards
on a running Ray cluster").

The new-shard flow is what the `<source>_new_shards` sensor and the `automation` sensor start (their
runs carry `TRIGGER_TAG`): per-shard runs from `raw` to `token_shards`, then cross-shard runs (the
dedup index, the cache's append). Each per-shard run is short; in Kubernetes it would otherwise wait
for a pod to be scheduled, where a Ray job starts on a node that is already up. dagster-ray's
`RayRunLauncher` submits the run as a Ray job through the cluster's job server (`dagster api
execute_run` on a node; in-process steps, as every run here). The cross-shard runs, `marin
materialize` plans, UI launches and training keep the wrapped launcher (`otherwise`: the local
default, or `K8sRunLauncher` in deploy/dagster.yaml).

A runtime choice of the instance (dagster.yaml), never part of any identity: the artifacts a run
commits are the same bytes wherever it ran. Before each submission the job server is asked for its
version (REACH_TIMEOUT_S); when it does not answer, `when_unreachable` decides: `fallback` launches
the run with the wrapped launcher and says so in the run's event log, `stop` fails the run in one
line before it starts. Either way nothing is half-committed: a run that never started wrote nothing.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

import dagster as dg
import yaml
from dagster._core.launcher import LaunchRunContext, ResumeRunContext, RunLauncher
from dagster._core.launcher.base import CheckRunHealthResult, WorkerStatus
from dagster._serdes import ConfigurableClass, ConfigurableClassData

from marin_resources.dagster_private import PARTITION_NAME_TAG
from marin_resources.keys import NEW_SHARD_FLOW_TRIGGERS, TRIGGER_TAG
from marin_resources.storage.secrets import SECRET_ENV_VARS
from marin_resources.typed_config import ConfigError

REACH_TIMEOUT_S = 5.0
# Run tag: which launcher started the run (`ray` or `otherwise`), read back to cancel it or check it.
LAUNCHED_BY_TAG = "marin/launched_by"
WHEN_UNREACHABLE = ("fallback", "stop")
# Read by the Ray job's run worker wherever the flow's runs go: the store, the project and the
# instance. The cluster's nodes must see the same paths (shared disk or object store).
DEFAULT_ENV_PREFIXES = ("MARIN_", "DAGSTER_", "RAY_AUTH_MODE", "HF_HUB_OFFLINE", "WANDB_MODE")


def job_server_problem(address: str, timeout_s: float = REACH_TIMEOUT_S, headers: dict[str, str] | None = None,
                       cookies: dict[str, str] | None = None) -> str | None:
    """None when the Ray job server at `address` (http://host:port) answers; else why not, one line.
    It is asked with the headers and cookies the submission sends (a proxy in front of it may refuse
    a request without them)."""
    sent = {**(headers or {}), **({"Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())} if cookies else {})}
    request = urllib.request.Request(address.rstrip("/") + "/api/version", headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            json.loads(response.read())
        return None
    except urllib.error.HTTPError as exc:
        return f"the Ray job server at {address} refuses the request (HTTP {exc.code} {exc.reason})"
    except (OSError, ValueError) as exc:
        return f"the Ray job server at {address} does not answer ({type(exc).__name__}: {exc})"


def is_new_shard_flow(run: dg.DagsterRun) -> bool:
    """A per-shard run the new-shard flow started: a sensor's run of one partition. The flow's
    cross-shard runs (the dedup index's group, the cache's append) stay with `otherwise`: they are
    few, they read the whole corpus's state, and a Ray job's start (14 s measured, against 6 s for
    a warm local worker) would only add to each."""
    return run.tags.get(TRIGGER_TAG) in NEW_SHARD_FLOW_TRIGGERS and PARTITION_NAME_TAG in run.tags


def on_its_interpreter(run: dg.DagsterRun) -> dg.DagsterRun:
    """The run, its worker started as `<the code location's python> -m dagster` rather than the bare
    `dagster` its origin names: a Ray job's shell has the node's PATH, where `dagster` may be missing
    or another environment's (measured here: `/bin/sh: dagster: not found`, the run never started)."""
    origin = run.job_code_origin
    if origin is None or origin.repository_origin.entry_point is None:
        return run
    return run._replace(job_code_origin=origin._replace(
        repository_origin=origin.repository_origin._replace(entry_point=None)))


def launcher_for(launcher: RunLauncher, run: dg.DagsterRun | None = None) -> RunLauncher:
    """The launcher that starts (or started) `run`: for a `NewShardRunLauncher`, the one it routes the
    run to; `run` None: a run outside the new-shard flow (a `marin materialize` plan's)."""
    if not isinstance(launcher, NewShardRunLauncher):
        return launcher
    return launcher.otherwise if run is None else launcher.launched_by(run)


def _launcher_from(spec: dict[str, Any] | None) -> RunLauncher:
    if spec is None:
        return dg.DefaultRunLauncher()
    data = ConfigurableClassData(spec["module"], spec["class"], yaml.safe_dump(spec.get("config") or {}))
    return data.rehydrate(as_type=RunLauncher)


class NewShardRunLauncher(RunLauncher, ConfigurableClass):
    def __init__(self, ray: dict[str, Any], when_unreachable: str = "fallback",
                 otherwise: dict[str, Any] | None = None, inst_data: ConfigurableClassData | None = None):
        if when_unreachable not in WHEN_UNREACHABLE:
            raise ConfigError(f"NewShardRunLauncher: when_unreachable must be one of {', '.join(WHEN_UNREACHABLE)}, "
                             f"got {when_unreachable!r}")
        self._inst_data = inst_data
        self.when_unreachable = when_unreachable
        # Unless the config lists them, the Ray job gets this process's settings (the daemon's). Never
        # its secrets: a Ray job's runtime_env is shown to whoever reaches the cluster's dashboard, so
        # they belong in the environment of the cluster's nodes, which each job inherits.
        named = [*(ray.get("env_vars") or []), *((ray.get("runtime_env") or {}).get("env_vars") or {})]
        secrets = sorted({name.partition("=")[0] for name in named} & set(SECRET_ENV_VARS))
        if secrets:
            raise ConfigError(f"NewShardRunLauncher: ray env_vars name the secret {', '.join(secrets)}, which the "
                             "Ray dashboard would show in each job's runtime_env; set it on the cluster's nodes")
        env_vars = sorted(k for k in os.environ if k.startswith(DEFAULT_ENV_PREFIXES) and k not in SECRET_ENV_VARS)
        from dagster_ray import RayRunLauncher  # seconds to import: only where the instance configures this launcher
        self.ray = RayRunLauncher(**{"env_vars": env_vars, **ray})
        self.otherwise = _launcher_from(otherwise)
        super().__init__()

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self._inst_data

    @classmethod
    def config_type(cls):
        return {
            "ray": dg.Field(dg.Permissive({"address": str}),
                            description="dagster-ray's RayRunLauncher config; `address` is the job server "
                                        "(http://head:8265)"),
            "when_unreachable": dg.Field(str, default_value="fallback",
                                         description="fallback (the `otherwise` launcher) or stop (the run fails)"),
            "otherwise": dg.Field(dg.Permissive({"module": str, "class": str}), is_required=False,
                                  description="the launcher of every other run (default: DefaultRunLauncher)"),
        }

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        return cls(inst_data=inst_data, **config_value)

    def register_instance(self, instance) -> None:
        super().register_instance(instance)
        self.ray.register_instance(instance)
        self.otherwise.register_instance(instance)

    def launched_by(self, run: dg.DagsterRun) -> RunLauncher:
        return self.ray if run.tags.get(LAUNCHED_BY_TAG) == "ray" else self.otherwise

    def _tagged(self, run: dg.DagsterRun, by: str) -> dg.DagsterRun:
        """`run` with LAUNCHED_BY_TAG `by`, stored before it launches. A run may come with another value:
        Dagster's retry of a failed run (run_retries) copies its parent's tags."""
        if run.tags.get(LAUNCHED_BY_TAG) == by:
            return run
        self._instance.add_run_tags(run.run_id, {LAUNCHED_BY_TAG: by})
        return run.with_tags({**run.tags, LAUNCHED_BY_TAG: by})

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        if not is_new_shard_flow(run):
            # Untagged means `otherwise`; a copied `ray` is corrected, or its cancel would go to Ray.
            if LAUNCHED_BY_TAG in run.tags:
                run = self._tagged(run, "otherwise")
            self.otherwise.launch_run(LaunchRunContext(run, context.workspace))
            return
        problem = job_server_problem(self.ray.address, headers=self.ray.headers, cookies=self.ray.cookies)
        if problem is None:
            self.ray.launch_run(LaunchRunContext(on_its_interpreter(self._tagged(run, "ray")), context.workspace))
            return
        if self.when_unreachable == "stop":
            self._instance.report_run_failed(run, f"not started: {problem}; when_unreachable: stop")
            return
        self._instance.report_engine_event(f"{problem}: launched by {type(self.otherwise).__name__} instead "
                                           "(when_unreachable: fallback)", run, cls=type(self))
        self.otherwise.launch_run(LaunchRunContext(self._tagged(run, "otherwise"), context.workspace))

    # Each run is checked, resumed or cancelled by the launcher that started it; the wrapped one may
    # support less than Ray's (the local default checks no worker and resumes nothing).
    @property
    def supports_resume_run(self) -> bool:
        return self.ray.supports_resume_run or self.otherwise.supports_resume_run

    def resume_run(self, context: ResumeRunContext) -> None:
        launcher = self.launched_by(context.dagster_run)
        if launcher is self.ray:
            context = context._replace(dagster_run=on_its_interpreter(context.dagster_run))
        launcher.resume_run(context)

    def terminate(self, run_id: str) -> bool:
        run = self._instance.get_run_by_id(run_id)
        return run is not None and self.launched_by(run).terminate(run_id)

    @property
    def supports_check_run_worker_health(self) -> bool:
        return self.ray.supports_check_run_worker_health or self.otherwise.supports_check_run_worker_health

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        launcher = self.launched_by(run)
        if not launcher.supports_check_run_worker_health:
            # What Dagster's run monitoring does for a launcher that checks no worker: nothing. UNKNOWN
            # would read as a lost worker, and the daemon would fail (or resume) a healthy run.
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"{type(launcher).__name__} checks no run worker")
        return launcher.check_run_worker_health(run)

    def get_run_worker_debug_info(self, run: dg.DagsterRun, include_container_logs: bool | None = True) -> str | None:
        # Run monitoring adds it to a failed worker's message: the Ray job's details, or the pod's logs.
        return self.launched_by(run).get_run_worker_debug_info(run, include_container_logs=include_container_logs)

    def dispose(self) -> None:
        self.ray.dispose()
        self.otherwise.dispose()
