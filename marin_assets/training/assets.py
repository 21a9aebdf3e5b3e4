"""Training and evaluation assets, partitioned by run name:

    mixture/<m> + tokenizer/<t>  -->  checkpoint[run]  -->  eval[run]

Each run is a `RunSpec`: the deployment's named runs (`runs.yaml`) are partitions of `checkpoint`
and `eval`; each scaling sweep gets its own pair of the same assets (`build_run_assets`) over its
own runs, so a sweep's unbuilt runs never make the named runs look unfinished. The spec's
identity is the artifact's identity; its `resources` are runtime placement.
Training runs in a separate process launched through Dagster Pipes (Levanter and JAX are never
imported here); a killed or failed run resumes from Levanter's latest checkpoint on re-run.
"""

import functools
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import yaml

from marin_assets.automation import PINS_INPUTS_TAG
from marin_assets.catalog import Catalog
from marin_assets.deployment import Deployment
from marin_assets.tokenization.assets import mixture_caches, read_mixture_config
from marin_assets.training.commands import EVAL_REPORT_FILE, eval_command, train_command
from marin_assets.training.eval_main import REPORT_VERSION
from marin_assets.training.init_weights import InitWeights, InitWeightsError, resolve_export, resolve_path
from marin_assets.training.levanter_config import (
    TRAIN_CONFIG_FILE,
    WandbSettings,
    render_train_config,
    set_checkpoint_base,
)
from marin_assets.training.memory import ComputePlan, plan_run
from marin_assets.training.metrics import eval_lines
from marin_assets.training.sft import SFT_CHECKPOINT_KEY, SFT_EVAL_KEY
from marin_assets.training.spec import RunSpec, RunSpecError
from marin_assets.training.train_main import FINAL_EVAL_FILE, INPUT_ERROR_FILE, LOSS_CURVE_FILE, SUMMARY_FILE
from marin_resources.artifact_spec import ArtifactSpec, ReadsFn
from marin_resources.artifacts import (
    ArtifactHandle,
    Built,
    MarinStore,
    checked_manifest,
    input_refused,
    marin_check,
    materialize_artifact,
)
from marin_resources.display import png_markdown, records_table
from marin_resources.environments import MarinSettings, store_resource
from marin_resources.keys import asset_key
from marin_resources.launchers import ProcessCommand, TrainingLauncher
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import STORE_SCHEME, ArtifactStore, Manifest

CHECKPOINT_VERSION = "v1"
EVAL_VERSION = "v1"
RUNS = dg.DynamicPartitionsDefinition(name="runs")
SFT_RUNS = dg.DynamicPartitionsDefinition(name="sft_runs")
# A training step's own retry (deploy/dagster.yaml retries a run only when its worker died): one more
# attempt a minute later, for a pod or host lost under it, which resumes from the run's latest
# checkpoint. Refusals (`input_refused`) are never retried.
TRAINING_RETRY = dg.RetryPolicy(max_retries=1, delay=60)


def termination_is_final(step: Callable) -> Callable:
    """Under a retry policy Dagster retries an interrupted step, also when a person terminated its run (the
    UI's Terminate): the in-process executor would start the training again. Such an interrupt ends the
    step for good instead, and the run ends canceled; an interrupt nobody asked for (the run worker's pod
    preempted) keeps Dagster's retry."""
    @functools.wraps(step)
    def not_retried_once_terminated(context: dg.AssetExecutionContext, *args, **kwargs):
        try:
            return step(context, *args, **kwargs)
        except dg.DagsterExecutionInterruptedError:
            run = context.instance.get_run_by_id(context.run_id)
            if run is not None and run.status == dg.DagsterRunStatus.CANCELING:
                raise dg.Failure("the run was terminated", allow_retries=False) from None
            raise
    return not_retried_once_terminated
TRAIN_METRIC_KEYS = ("train_loss_first", "train_loss_last", "final_step", "tokens_per_second", "parameter_count",
                     "mfu", "eval_loss_last", "flops_per_token", "resumed_from_step", "attempt", "train_seconds",
                     "device_kind", "device_count", "process_count", "mesh_data", "mesh_fsdp", "mesh_tensor",
                     "wandb_run_dir")


def local_dir(store: MarinStore, writer) -> str:
    """Levanter and the training process write to a local path; on object stores, a staging dir."""
    return str(writer.staging_dir())


def find_handle(store: MarinStore, spec: ArtifactSpec) -> ArtifactHandle:
    """The committed artifact of an unpartitioned input the run names (its mixture, its tokenizer)."""
    manifest = store.get().find(spec.key, spec.version, None)
    if manifest is None:
        raise dg.Failure(f"{spec.key} has no committed artifact at {spec.version}; materialize it first "
                         f"(marin materialize {spec.key})")
    return ArtifactHandle.from_manifest(manifest)


def check_pool(spec: RunSpec, asset_pool: str) -> None:
    """A run that names a pool runs only in a step holding that pool's slot.

    Dagster claims pool slots per asset (``pool=`` on the definition), not per partition, so the
    training assets hold the deployment's training pool; a run asking for another one is refused
    before anything is launched instead of running outside its pool's limit.
    """
    wanted = spec.resources.pool
    if wanted is not None and wanted != asset_pool:
        raise input_refused(f"run {spec.name!r} asks for pool {wanted!r}, but this deployment's training assets hold "
                         f"pool {asset_pool!r}; set MARIN_TRAIN_POOL={wanted} where such runs are launched")


def relocated_train_config(text: str, checkpoint_uri: str, store: ArtifactStore) -> str:
    """A checkpoint's Levanter config (absolute paths, as Levanter needs them) as seen from where the
    checkpoint is now: when the store was copied to another prefix, every path under the prefix it
    was written under points under this store's prefix instead."""
    base = str(yaml.safe_load(text)["trainer"]["checkpointer"]["base_path"])
    written = base.rstrip("/").removesuffix("/checkpoints")
    relative = store.portable(checkpoint_uri).removeprefix(STORE_SCHEME)
    if written == checkpoint_uri or not written.endswith("/" + relative):
        return text
    return text.replace(written[:-len(relative)], store.prefix + "/")


def resolve_init_weights(spec: RunSpec, store: ArtifactStore) -> tuple[InitWeights | None, list[ArtifactHandle]]:
    """The weights ``spec`` starts from (its ``init_from``), pinned and hashed, and the artifacts they
    are (another run's ``hf_model``, an input of the checkpoint); ``(None, [])`` for a run from scratch.
    Raises `InitWeightsError` (one line) for a source that is not there or not a model directory."""
    init = spec.init_from
    if init is None:
        return None, []
    if init.run is not None:
        from marin_assets.training.export_main import HF_MODEL_KEY, HF_MODEL_VERSION

        manifest = store.find(HF_MODEL_KEY, HF_MODEL_VERSION, init.run)
        if manifest is None:
            raise InitWeightsError(f"run {spec.name!r} starts from the export of run {init.run!r}, which has none "
                                   f"yet: marin materialize {HF_MODEL_KEY} --partition {init.run}")
        weights = resolve_export(manifest.uri, {f.path: f.sha256 for f in manifest.files}, manifest.uri)
        return weights, [ArtifactHandle.from_manifest(manifest)]
    from marin_assets.curation.content_hashes import ContentHashCache

    with ContentHashCache() as hashes:
        return resolve_path(init.path, hashes), []


def cooldown_checkpoint(spec: RunSpec, store: ArtifactStore, checkpoints: ArtifactSpec) -> tuple[Manifest, str]:
    """The committed checkpoint of the run ``spec`` cools down from, of the identity that run has now,
    and the directory of its step the cooldown starts at. `InitWeightsError` (one line) when there
    is none yet, or it kept no checkpoint at that step."""
    base, step = spec.cooldown.run, spec.cooldown.step
    wanted = checkpoints.identity(base)
    manifest = None if wanted is None else store.find(checkpoints.key, checkpoints.version, base,
                                                      fingerprint=fingerprint(wanted))
    if manifest is None:
        raise InitWeightsError(f"run {spec.name!r} cools down from run {base!r}, whose checkpoint is not built as "
                               f"declared: marin materialize {checkpoints.key} --partition {base}")
    step_dir = f"checkpoints/step-{step}"
    if not any(f.path == f"{step_dir}/metadata.json" for f in manifest.files):
        raise InitWeightsError(f"run {spec.name!r} cools down from step {step} of run {base!r}, whose checkpoint "
                               f"{manifest.uri} kept no {step_dir}")
    return manifest, f"{manifest.uri}/{step_dir}"


def checkpoint_identity(spec: RunSpec, store: ArtifactStore) -> dict[str, Any] | None:
    """The identity of the run's checkpoint, with its initial weights' content hash; None while they
    cannot be resolved (the checkpoint asset then fails, naming why; status follows the last artifact)."""
    try:
        weights, _ = resolve_init_weights(spec, store)
    except InitWeightsError:
        return None
    return spec.identity(weights.sha256 if weights else None)


def run_quoting_input_errors(launcher: TrainingLauncher, context, process: ProcessCommand, error_file: Path,
                             label: str, **kwargs):
    """``launcher.run_process``; a process that refused its input (`process.input_errors`: one line in
    ``error_file``, exit 2) fails the step with that line instead of a traceback."""
    try:
        return launcher.run_process(context, process, **kwargs)
    except dg.DagsterExecutionInterruptedError:
        raise
    except Exception:
        if error_file.exists():
            message = error_file.read_text().strip()
            error_file.unlink()
            raise input_refused(f"{label}: {message}") from None
        raise


def launcher_wandb(launcher: TrainingLauncher, spec: RunSpec) -> WandbSettings:
    """The tracker settings of a run launched by ``launcher`` (online only when it holds an API key)."""
    return WandbSettings(project=launcher.wandb_project, entity=launcher.wandb_entity,
                         mode="online" if launcher.wandb_online() else "offline", tags=(spec.mixture,))


SpecLookup = Callable[[str], RunSpec]
ComputePlanner = Callable[[RunSpec], ComputePlan]


def compute_planner(settings: MarinSettings, deployment: Deployment) -> ComputePlanner:
    """How a run of this deployment computes on the devices it names, planned against their memory
    (`memory.plan_run`) when it launches; raises `RunSpecError` for a run no setting fits."""
    return lambda spec: plan_run(spec, deployment.vocab_size(spec), settings.gpu_type)


def run_specs(checkpoint_key: str, eval_key: str, spec_for: SpecLookup, store: Callable[[], ArtifactStore],
              reads: ReadsFn | None = None) -> tuple[ArtifactSpec, ArtifactSpec]:
    """The artifact specs of a set of runs' checkpoints and evals (``store``: where a run's initial
    weights are resolved, opened only for runs that have them)."""
    def checkpoint_config(run: str | None) -> dict[str, Any] | None:
        spec = spec_for(str(run))
        if spec.cooldown is not None:  # the checkpoint it continues, as its run is declared now
            base = checkpoint_config(spec.cooldown.run)
            return None if base is None else spec.identity(cooldown_base=fingerprint(base))
        return spec.identity() if spec.init_from is None else checkpoint_identity(spec, store())

    def starts_from(run: str) -> list[str]:
        spec = spec_for(run)
        return [spec.cooldown.run] if spec.cooldown is not None else []

    return (ArtifactSpec(checkpoint_key, CHECKPOINT_VERSION, checkpoint_config, reads=reads, starts_from=starts_from),
            ArtifactSpec(eval_key, EVAL_VERSION, lambda run: spec_for(str(run)).eval_identity(),
                         results=lambda manifest: eval_lines(manifest.metrics)))


def build_run_assets(*, checkpoint_key: str, eval_key: str, partitions: dg.DynamicPartitionsDefinition,
                     spec_for: SpecLookup, plan_for: ComputePlanner, mixtures: Mapping[str, ArtifactSpec],
                     tokenizers: Mapping[str, ArtifactSpec], pool: str, group_name: str, catalog: Catalog,
                     store: Callable[[], ArtifactStore], reads: ReadsFn | None = None,
                     tags: dict[str, str] | None = None,
                     subject: str = "") -> tuple[list, list]:
    """A checkpoint asset and its eval asset over ``partitions``, a run per partition; ``spec_for``
    gives a partition's `RunSpec` when a step runs (it raises dg.Failure for an unknown run), ``plan_for``
    how it computes (`compute_planner`). ``mixtures`` and ``tokenizers``: the specs of those a run may name,
    by name."""
    checkpoint_spec, eval_spec = run_specs(checkpoint_key, eval_key, spec_for, store, reads)
    upstream_keys = [asset_key(specs[name].key) for specs in (mixtures, tokenizers) for name in sorted(specs)]
    # A run of either reads its inputs for a long time: automation rebuilds nothing upstream meanwhile.
    tags = {"marin/partitioned_by": "run", PINS_INPUTS_TAG: "true", **(tags or {})}

    @catalog.asset(checkpoint_spec, partitions_def=partitions, deps=upstream_keys, retry_policy=TRAINING_RETRY,
                   group_name=group_name, kinds={"levanter", "jax"}, pool=pool, tags=tags,
                   description=f"A Levanter training run{subject}: `checkpoints/step-N/` in Levanter's layout, the "
                               "generated `train_config.yaml`, per-step `metrics.jsonl` and a loss curve. "
                               "Re-materializing a killed or failed run resumes from its latest checkpoint; a "
                               "finished run is a cache hit.")
    @termination_is_final
    def checkpoint(context: dg.AssetExecutionContext, store: MarinStore, launcher: TrainingLauncher):
        spec = spec_for(context.partition_key)
        check_pool(spec, pool)
        artifacts = store.get()
        mixture = find_handle(store, mixtures[spec.mixture])
        tokenizer = find_handle(store, tokenizers[spec.tokenizer])
        data_config = read_mixture_config(artifacts, mixture)
        # The caches the run reads, as committed now: the exact ones its manifest records (an append
        # leaves the mixture's bytes as they were, so the mixture alone would not say which).
        caches = mixture_caches(artifacts, data_config, mixture)
        label = f"{checkpoint_key}[{spec.name}]"
        try:
            weights, sources = resolve_init_weights(spec, artifacts)
        except InitWeightsError as exc:
            raise input_refused(f"{label}: {exc}") from None
        init_sha256 = weights.sha256 if weights else None
        cooldown_base, cooldown_from = None, None
        if spec.cooldown is not None:
            try:
                base_manifest, cooldown_from = cooldown_checkpoint(spec, artifacts, checkpoint_spec)
            except InitWeightsError as exc:
                raise input_refused(f"{label}: {exc}") from None
            cooldown_base = base_manifest.fingerprint
            sources = [*sources, ArtifactHandle.from_manifest(base_manifest)]
        # The spec resolves the weights again (as status does); were they replaced in between, the
        # run would train on other weights than its identity names.
        if checkpoint_spec.identity(context.partition_key) != spec.identity(init_sha256, cooldown_base):
            raise input_refused(f"{label}: the initial weights changed while the run started; materialize it again")
        def build(writer) -> Built:
            # Before any process opens a device: a setting that fits its memory, or a one-line refusal.
            try:
                plan = plan_for(spec)
            except RunSpecError as exc:
                raise input_refused(f"{label}: {exc}") from None
            context.log.info(f"{label}: {plan.describe()}")
            out = local_dir(store, writer)
            config_path = render_train_config(spec, data_config, tokenizer.uri, out, launcher_wandb(launcher, spec),
                                              init_weights=weights, compute=plan.settings,
                                              cooldown_from=cooldown_from)
            if not artifacts.is_local:
                # Levanter (tensorstore) saves each checkpoint straight into the bucket, where a re-run
                # on any machine resumes from it; `out` is scratch for logs, uploaded at commit.
                set_checkpoint_base(config_path, writer.path("checkpoints"))
            run_quoting_input_errors(launcher, context, train_command(config_path, out, final_eval=True,
                                                                      final_eval_examples=spec.final_eval_examples,
                                                                      init_sha256=init_sha256,
                                                                      fused_loss=plan.settings.fused_loss),
                                     Path(out) / INPUT_ERROR_FILE, label, resources=spec.resources,
                                     extras={"run": spec.name,
                                             "fingerprint": spec.fingerprint(init_sha256, cooldown_base)})
            # The summary file, not the Pipes message, is the record: a lost message must not commit
            # a checkpoint without its metrics.
            summary_path = Path(out) / SUMMARY_FILE
            if not summary_path.exists():
                raise dg.Failure(f"training exited without writing {summary_path}")
            summary = json.loads(summary_path.read_text())
            metrics = {k: summary[k] for k in TRAIN_METRIC_KEYS if summary.get(k) is not None}
            metrics["compute"] = plan.metadata()  # how it was computed: runtime, never in the fingerprint
            # W&B's run directory is in the metrics (wandb_run_dir), shown once.
            metadata: dict[str, Any] = {}
            if summary.get("sharded_weight"):
                metadata["sharded_weight"] = dg.MetadataValue.json(summary["sharded_weight"])
            return Built(metrics=metrics, metadata=metadata)

        # resume=True keeps Levanter's checkpoints from an interrupted attempt.
        return materialize_artifact(context, store, checkpoint_spec, upstream=[mixture, tokenizer, *caches, *sources],
                                    build=build, resume=True,
                                    describe=lambda manifest: checkpoint_display(artifacts, manifest, spec, weights))

    @marin_check(checkpoint, name="loss_fell",
                    description="The final training loss is finite and lower than the first.")
    def loss_fell(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        manifest = checked_manifest(context, store, checkpoint_spec)
        if manifest is None:
            return dg.AssetCheckResult(passed=False, metadata={"error": "no committed checkpoint"})
        first, last = manifest.metrics.get("train_loss_first"), manifest.metrics.get("train_loss_last")
        ok = first is not None and last is not None and math.isfinite(last) and last < first
        return dg.AssetCheckResult(passed=bool(ok), metadata={"train_loss_first": first, "train_loss_last": last},
                                   description=None if ok else f"train_loss_last={last} is not finite and below "
                                                               f"train_loss_first={first}")

    @catalog.asset(eval_spec, partitions_def=partitions, group_name=group_name, pool=pool,
                   ins={"checkpoint": dg.AssetIn(key=checkpoint.key)}, kinds={"levanter"}, tags=tags,
                   description=f"Evaluation of a run's final checkpoint{subject} with Levanter: loss and bits-per-byte "
                               "on each validation set, greedy samples, and a JSON report (`eval_report.json`).")
    def evaluation(context: dg.AssetExecutionContext, store: MarinStore, launcher: TrainingLauncher,
                   checkpoint: ArtifactHandle):
        spec = spec_for(context.partition_key)
        check_pool(spec, pool)
        artifacts = store.get()

        def build(writer) -> Built:
            out = local_dir(store, writer)
            report = final_eval_report(artifacts, checkpoint, spec.final_eval_examples)
            if report is not None:
                context.log.info(f"adopting {FINAL_EVAL_FILE}, written by the training process of {spec.name}")
                Path(out, EVAL_REPORT_FILE).write_text(json.dumps(report, indent=2))
                return eval_built(report, evaluated_by="training process")
            with tempfile.TemporaryDirectory(prefix="marin-eval-") as scratch:
                # The run's config names its checkpoints by URI (a local path, or the bucket), so
                # eval only needs a local copy of the config file itself.
                config_path = os.path.join(scratch, TRAIN_CONFIG_FILE)
                with artifacts.open(f"{checkpoint.uri}/{TRAIN_CONFIG_FILE}") as src:
                    text = src.read().decode("utf-8")
                Path(config_path).write_text(relocated_train_config(text, checkpoint.uri, artifacts))
                launcher.run_process(context, eval_command(config_path, out, sample_examples=spec.final_eval_examples),
                                     resources=spec.resources.for_evaluation(), extras={"run": spec.name})
            return eval_built(json.loads((Path(out) / EVAL_REPORT_FILE).read_text()), evaluated_by="eval process")

        return materialize_artifact(context, store, eval_spec, upstream=[checkpoint], build=build)

    @marin_check(evaluation, name="bpb_finite", description="Every eval set's bits-per-byte is finite.")
    def bpb_finite(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        manifest = checked_manifest(context, store, eval_spec)
        if manifest is None:
            return dg.AssetCheckResult(passed=False, metadata={"error": "no committed eval"})
        bpb = {k: v for k, v in manifest.metrics.items() if k.endswith("/bpb")}
        broken = [f"{k}={v}" for k, v in bpb.items() if not math.isfinite(v)] or ([] if bpb else ["no eval set's bpb"])
        return dg.AssetCheckResult(passed=not broken, metadata={k: float(v) for k, v in bpb.items()},
                                   description="; ".join(broken) or None)

    return [checkpoint, evaluation], [loss_fell, bpb_finite]


def checkpoint_display(store: ArtifactStore, manifest: Manifest, spec: RunSpec,
                       weights: InitWeights | None) -> dict[str, Any]:
    """What the UI shows of a committed checkpoint on each of its materializations, a reuse too:
    the run, its model family and optimizer, the weights it started from, and its loss curve (the
    `loss_curve.png` the training process committed with it)."""
    metadata: dict[str, Any] = {"run": spec.name, "model_family": spec.model.family, "optimizer": spec.optimizer.type}
    if weights is not None:
        metadata["init_from"] = dg.MetadataValue.json({"uri": weights.uri, "sha256": weights.sha256,
                                                       "files": dict(weights.files)})
    if any(f.path == LOSS_CURVE_FILE for f in manifest.files):
        with store.open(f"{manifest.uri}/{LOSS_CURVE_FILE}") as fh:
            metadata["loss_curve"] = png_markdown(fh.read(), f"loss curve of {spec.name}")
    return metadata


def final_eval_report(store: ArtifactStore, checkpoint: ArtifactHandle,
                      sample_examples: int | None = None) -> dict[str, Any] | None:
    """The checkpoint's final-eval report (`train_main --final-eval`), if it has one this eval code
    would have written for this sample (None: every sequence): None for a checkpoint from before it,
    or one whose report is of another version or scored another sample."""
    try:
        with store.open(f"{checkpoint.uri}/{FINAL_EVAL_FILE}") as fh:
            report = json.loads(fh.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    same_sample = report.get("sample_examples") == sample_examples
    return report if report.get("report_version") == REPORT_VERSION and same_sample else None


def eval_built(report: dict[str, Any], *, evaluated_by: str) -> Built:
    metrics = {k: v for k, v in report.items() if k.startswith("eval/") and isinstance(v, (int, float))}
    metadata: dict[str, Any] = {"evaluated_by": evaluated_by}
    if report.get("samples"):
        metadata["samples"] = records_table(report["samples"])
    return Built(metrics=metrics, metadata=metadata)


def named_run_lookup(settings: MarinSettings, deployment: Deployment, *, sft: bool = False) -> SpecLookup:
    """The spec of one of the deployment's named runs (`runs.yaml`), or with ``sft`` of its SFT runs
    (the project file's ``sft_runs:``); dg.Failure for any other name."""
    runs = dict(deployment.sft_runs if sft else deployment.runs)
    project = f" and {settings.project.path}" if settings.project is not None else ""
    where = f"SFT runs ({settings.project.path if settings.project is not None else 'no project file'})" if sft \
        else f"runs ({settings.runs_file or 'the bundled runs.yaml'}{project})"

    def spec_for(run: str) -> RunSpec:
        if run not in runs:
            raise input_refused(f"no run named {run!r} in this deployment's {where}; known: {sorted(runs)}")
        return runs[run]

    return spec_for


def mixture_specs(deployment: Deployment, upstream: Catalog) -> dict[str, ArtifactSpec]:
    """The specs of the deployment's mixtures, as the tokenization stage declared them."""
    return {name: upstream.spec(f"mixture/{name}") for name in deployment.tokenization.mixtures}


def tokenizer_specs(deployment: Deployment, upstream: Catalog) -> dict[str, ArtifactSpec]:
    """The specs of the deployment's tokenizers, as the tokenization stage declared them."""
    return {name: upstream.spec(f"tokenizer/{name}") for name in deployment.tokenization.tokenizers}


def run_reads(spec: RunSpec | None, mixtures: Mapping[str, ArtifactSpec],
              tokenizers: Mapping[str, ArtifactSpec]) -> set[str]:
    """What a named run reads of the inputs `checkpoint` declares (every run's mixture and tokenizer):
    its own two, so building it builds no other run's data. None (a partition of no run here, refused
    when its step runs): nothing."""
    return set() if spec is None else {mixtures[spec.mixture].key, tokenizers[spec.tokenizer].key}


def build_training_stage(settings: MarinSettings, deployment: Deployment,
                         upstream: Catalog) -> tuple[dg.Definitions, Catalog]:
    """`checkpoint` and `eval` over the deployment's named runs (`runs.yaml`), and `sft_checkpoint` and
    `sft_eval` over its SFT runs (the project file's ``sft_runs:``) where it declares some."""
    catalog = Catalog()
    mixtures, tokenizers = mixture_specs(deployment, upstream), tokenizer_specs(deployment, upstream)
    families = [("checkpoint", "eval", RUNS, deployment.runs, False, "")]
    if deployment.sft_runs:  # none in the demo: its graph, and so its fingerprints, are unchanged
        families.append((SFT_CHECKPOINT_KEY, SFT_EVAL_KEY, SFT_RUNS, deployment.sft_runs, True,
                         " fine-tuning pretrained weights on chat data, the loss on the assistant's tokens only"))
    assets, checks = [], []
    for checkpoint_key, eval_key, partitions, runs, sft, subject in families:
        catalog.add_discoverer(partitions.name, lambda runs=runs: sorted(runs))
        family_assets, family_checks = build_run_assets(
            checkpoint_key=checkpoint_key, eval_key=eval_key, partitions=partitions,
            spec_for=named_run_lookup(settings, deployment, sft=sft), plan_for=compute_planner(settings, deployment),
            mixtures=mixtures, tokenizers=tokenizers, pool=settings.train_pool, group_name="training",
            catalog=catalog, store=store_resource(settings).get, subject=subject,
            reads=lambda run, runs=runs: run_reads(runs.get(run), mixtures, tokenizers))
        assets += family_assets
        checks += family_checks
    return dg.Definitions(assets=assets, asset_checks=checks), catalog
