"""Export to Hugging Face:

    checkpoint[run]  -->  hf_model[run]

``hf_model[run]`` is a run's final checkpoint (or a chosen step) as a Hugging Face model directory:
``config.json``, ``generation_config.json``, ``model.safetensors`` (float32; sharded past
``max_shard_mb``), and the run's tokenizer framing text as the token cache framed documents. It is
written by a separate process (`marin_assets.training.export_main`, launched like ``eval``:
Levanter and JAX are never imported here), which loads the result back with transformers and
compares it with Levanter's model before anything is committed.
"""

import hashlib
import json
import os
import tempfile
from pathlib import Path

import dagster as dg

from marin_assets.catalog import Catalog
from marin_assets.deployment import Deployment
from marin_assets.training.assets import (
    RUNS,
    SFT_RUNS,
    SpecLookup,
    check_pool,
    local_dir,
    named_run_lookup,
    relocated_train_config,
    run_quoting_input_errors,
)
from marin_assets.training.commands import export_command
from marin_assets.training.export_main import EXPORT_ERROR_FILE, EXPORT_REPORT_FILE, HF_MODEL_KEY, HF_MODEL_VERSION
from marin_assets.training.levanter_config import TRAIN_CONFIG_FILE
from marin_assets.training.sft import SFT_CHECKPOINT_KEY, SFT_HF_MODEL_KEY
from marin_assets.training.spec import RunSpec
from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import (
    ArtifactHandle,
    Built,
    MarinStore,
    input_of,
    input_refused,
    materialize_artifact,
)
from marin_resources.environments import MarinSettings
from marin_resources.launchers import TrainingLauncher
from marin_resources.storage.store import FileEntry, Manifest

DEFAULT_MAX_SHARD_MB = 2048


class ExportConfig(dg.Config):
    """Which checkpoint to export, and how the weights are split into files."""

    step: int | None = None
    """A checkpoint step (``checkpoints/step-N``); None: the run's final checkpoint."""
    max_shard_mb: int = DEFAULT_MAX_SHARD_MB
    """Weights past this many MiB are written as several safetensors files and an index."""


def export_identity(spec: RunSpec, config: ExportConfig) -> dict:
    """What defines an export: the run (its checkpoint), the step and the file layout. The
    checkpoint's and tokenizer's data versions are its upstream, recorded by the manifest."""
    return {"run": spec.identity(), "step": config.step, "max_shard_mb": config.max_shard_mb}


GENERATION_PROMPT = "To be, or not to be"


def loading_snippet(path: str) -> str:
    """The lines the demo prints and docs/training.md shows: load the export, continue a prompt greedily.
    The prompt is BOS + text (no EOS), and generation stops at EOS (`generation_config.json`)."""
    return (f"from transformers import AutoTokenizer, FlaxLlamaForCausalLM  # or LlamaForCausalLM with torch\n"
            f"tokenizer = AutoTokenizer.from_pretrained({path!r})\n"
            f"model = FlaxLlamaForCausalLM.from_pretrained({path!r})\n"
            f"prompt = tokenizer({GENERATION_PROMPT!r}, return_tensors='np').input_ids\n"
            f"output = model.generate(prompt, max_new_tokens=40, do_sample=False).sequences\n"
            f"print(tokenizer.decode(output[0], skip_special_tokens=True))")


def hf_model_spec(spec_for: SpecLookup, key: str = HF_MODEL_KEY) -> ArtifactSpec:
    def identity(run: str | None, config: ExportConfig | None = None) -> dict:
        return export_identity(spec_for(str(run)), ExportConfig() if config is None else config)

    return ArtifactSpec(key, HF_MODEL_VERSION, identity, run_config=ExportConfig, results=export_lines)


def export_lines(manifest: Manifest) -> list[str]:
    """Where the export is, and how closely transformers reproduced Levanter's model, as `marin
    materialize` prints it once the export is built."""
    metrics = manifest.metrics
    check = (f"transformers' logits within {metrics['max_abs_logit_difference']:.1e} of Levanter's, greedy "
             f"generation {'the same' if metrics.get('greedy_matches') else 'DIFFERENT'}"
             if "max_abs_logit_difference" in metrics else "")
    return [f"Hugging Face model at {manifest.uri}" + (f" ({check})" if check else "")]


def build_hf_model_asset(*, spec_for: SpecLookup, pool: str, catalog: Catalog, checkpoint: ArtifactSpec,
                         key: str = HF_MODEL_KEY, partitions: dg.DynamicPartitionsDefinition = RUNS):
    """``key`` (``hf_model``, or ``sft_hf_model`` of the SFT runs) over ``partitions``, exporting ``checkpoint``."""
    artifact = hf_model_spec(spec_for, key)

    @catalog.asset(artifact, partitions_def=partitions, group_name="export", pool=pool,
                   ins={"checkpoint": input_of(checkpoint)}, kinds={"huggingface", "safetensors"},
                   tags={"marin/partitioned_by": "run"},
                   description="A run's final checkpoint (or a chosen step) as a Hugging Face model directory: "
                               "`config.json`, `generation_config.json`, float32 `model.safetensors` and the run's "
                               "tokenizer, which adds BOS (not EOS) to a text, so a prompt starts as a "
                               "document did. Loaded back with transformers and compared with Levanter's model "
                               "(logits on validation sequences, greedy generation) before it is committed.")
    def hf_model(context: dg.AssetExecutionContext, config: ExportConfig, store: MarinStore,
                 launcher: TrainingLauncher, checkpoint: ArtifactHandle):
        spec = spec_for(context.partition_key)
        check_pool(spec, pool)
        if spec.model.family != "llama":
            raise input_refused(f"{key}[{spec.name}]: a {spec.model.family} model cannot be exported yet; "
                                "export writes transformers' Llama (family llama only)")
        artifacts = store.get()
        checkpoint_path = None
        if config.step is not None:
            checkpoint_path = f"{artifacts.fs_path(checkpoint.uri)}/checkpoints/step-{config.step}"
            if not artifacts.fs.exists(f"{checkpoint_path}/metadata.json"):
                steps = sorted(int(p.rsplit("-", 1)[1]) for p in artifacts.fs.glob(
                    f"{artifacts.fs_path(checkpoint.uri)}/checkpoints/step-*"))
                raise input_refused(f"{key}[{spec.name}]: {checkpoint.uri} has no checkpoint at step {config.step}; "
                                 f"it has steps {steps}")
            checkpoint_path = artifacts.fs.unstrip_protocol(checkpoint_path) if "://" in checkpoint.uri \
                else checkpoint_path

        def build(writer) -> Built:
            out = Path(local_dir(store, writer))
            with tempfile.TemporaryDirectory(prefix="marin-export-") as scratch:
                config_path = os.path.join(scratch, TRAIN_CONFIG_FILE)
                with artifacts.open(f"{checkpoint.uri}/{TRAIN_CONFIG_FILE}") as src:
                    text = src.read().decode("utf-8")
                Path(config_path).write_text(relocated_train_config(text, checkpoint.uri, artifacts))
                run_quoting_input_errors(launcher, context,
                                         export_command(config_path, str(out), checkpoint_path=checkpoint_path,
                                                        max_shard_bytes=config.max_shard_mb * 1024**2),
                                         out / EXPORT_ERROR_FILE, f"{key}[{spec.name}]",
                                         resources=spec.resources, extras={"run": spec.name})
            report = json.loads((out / EXPORT_REPORT_FILE).read_text())
            weights = weight_entries(out, report["weight_files"])
            writer.vouch(weights)
            metrics = {k: v for k, v in report.items() if not isinstance(v, list)}
            metadata = {"run": spec.name, "parameters": report["parameters"], "dtype": report["dtype"],
                        "weight_bytes": report["weight_bytes"],
                        "weights_sha256": dg.MetadataValue.json({e.path: e.sha256 for e in weights}),
                        "load_it": dg.MetadataValue.md(f"```python\n{loading_snippet(writer.uri)}\n```")}
            return Built(metrics=metrics, metadata=metadata)

        return materialize_artifact(context, store, artifact, upstream=[checkpoint], build=build, run_config=config)

    return hf_model


def weight_entries(out: Path, files: list[str]) -> list[FileEntry]:
    """The weight files' entries (read once here: the commit takes them instead of reading again)."""
    entries = []
    for name in files:
        digest, size = hashlib.sha256(), 0
        with open(out / name, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
        entries.append(FileEntry(name, size, digest.hexdigest()))
    return entries


def build_export_stage(settings: MarinSettings, deployment: Deployment,
                       upstream: Catalog) -> tuple[dg.Definitions, Catalog]:
    """`hf_model` over the deployment's named runs, and `sft_hf_model` over its SFT runs where it declares some."""
    catalog = Catalog()
    assets = [build_hf_model_asset(spec_for=named_run_lookup(settings, deployment), pool=settings.train_pool,
                                   catalog=catalog, checkpoint=upstream.spec("checkpoint"))]
    if deployment.sft_runs:
        assets.append(build_hf_model_asset(spec_for=named_run_lookup(settings, deployment, sft=True),
                                           pool=settings.train_pool, catalog=catalog,
                                           checkpoint=upstream.spec(SFT_CHECKPOINT_KEY), key=SFT_HF_MODEL_KEY,
                                           partitions=SFT_RUNS))
    return dg.Definitions(assets=assets), catalog
