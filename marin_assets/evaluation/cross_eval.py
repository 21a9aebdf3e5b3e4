"""Cross-evaluation: any run's final checkpoint on any source's held-out split.

    checkpoint[run]  --+
    tokenized/<source>  --+-->  cross_eval/<source>[run]

``eval[run]`` scores a run on the validation sets of its own mixture; ``cross_eval/<source>[run]``
scores it on the validation split of ``tokenized/<source>``, a source it may never have seen (a new
source added to the deployment, another mixture's data), with the same process and the same
definitions of loss and bits-per-byte (`eval_main`). A chat cache is read as chat data, its loss on
the assistant's tokens: a base model scored as its fine-tuned run's `sft_eval` scores that. The run's
config is rewritten to read that one cache (`levanter_config.validation_only_config`); model,
tokenizer and checkpoint stay the run's.

Both sides must share the tokenizer, by name and by the tokenizer artifact they were built from:
a run scored on tokens of another vocabulary gives numbers that mean nothing, so that is refused in
one line before any process starts.
"""

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import dagster as dg
import yaml

from marin_assets.catalog import Catalog
from marin_assets.deployment import Deployment
from marin_assets.tokenization.assets import cache_chat_template
from marin_assets.training.assets import (
    EVAL_VERSION,
    RUNS,
    SpecLookup,
    check_pool,
    eval_built,
    local_dir,
    named_run_lookup,
    relocated_train_config,
)
from marin_assets.training.commands import EVAL_REPORT_FILE, eval_command
from marin_assets.training.levanter_config import TRAIN_CONFIG_FILE, validation_only_config
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
from marin_resources.storage.store import Manifest

CROSS_EVAL_VERSION = EVAL_VERSION
"""The same process and report as eval[run]: a change to one is a change to both."""


def cross_eval_key(source: str) -> str:
    return f"cross_eval/{source}"


def cross_eval_identity(spec: RunSpec, source: str) -> dict[str, Any]:
    """What defines a cross-evaluation: the run (and its evaluated sample, as for eval[run]) and the
    eval set; the checkpoint's and the cache's data versions are its upstream."""
    return {**spec.eval_identity(), "eval_set": source}


def tokenizer_mismatch(run: RunSpec, checkpoint: Manifest | None, source: str, tokenizer: str,
                       tokenized: Manifest | None) -> str | None:
    """Why ``run`` cannot be scored on ``tokenized/<source>`` (built with ``tokenizer/<tokenizer>``),
    in one line; None when both use the same tokenizer, by name and, where both manifests record
    it, by the tokenizer artifact's data version."""
    if run.tokenizer != tokenizer:
        return (f"tokenized/{source} is tokenized with tokenizer/{tokenizer}, run {run.name!r} was trained with "
                f"tokenizer/{run.tokenizer}: loss and bits-per-byte across vocabularies mean nothing")
    key = f"tokenizer/{tokenizer}"
    versions = [next((u.data_version for u in m.upstream if u.asset_key == key), None) if m else None
                for m in (checkpoint, tokenized)]
    if None not in versions and versions[0] != versions[1]:
        return (f"run {run.name!r} was trained with {key} at data version {versions[0][:12]}, tokenized/{source} "
                f"was built with it at {versions[1][:12]}: rebuild one of them so both use the same tokenizer")
    return None


def build_cross_eval_asset(source: str, tokenizer: str, *, spec_for: SpecLookup, pool: str, catalog: Catalog,
                           checkpoint: ArtifactSpec, tokenized: ArtifactSpec, chat: bool = False):
    """``cross_eval/<source>`` over the named runs (partitions of ``checkpoint``), scored on ``tokenized``
    (with ``chat``, a chat cache: read with its template, the loss on the assistant's tokens)."""
    key = cross_eval_key(source)
    artifact = ArtifactSpec(key, CROSS_EVAL_VERSION, lambda run: cross_eval_identity(spec_for(str(run)), source))

    @catalog.asset(artifact, partitions_def=RUNS, group_name="evaluation", pool=pool,
                   ins={"checkpoint": input_of(checkpoint), "tokenized": input_of(tokenized)},
                   kinds={"levanter"}, tags={"marin/partitioned_by": "run"},
                   description=f"A run's final checkpoint scored on the validation split of `tokenized/{source}` "
                               f"(tokenizer `{tokenizer}`), whatever the run trained on: `eval/{source}/loss`, "
                               f"`eval/{source}/bpb`, tokens and bytes, as `eval` defines them (of a chat cache: "
                               "over the assistant's tokens, as an SFT run's eval counts them), and greedy samples. "
                               "A run with another tokenizer is refused. Materialize it on demand: "
                               f"`marin materialize {key} --partition RUN`.")
    def cross_eval(context: dg.AssetExecutionContext, store: MarinStore, launcher: TrainingLauncher,
                   checkpoint: ArtifactHandle, tokenized: ArtifactHandle):
        spec = spec_for(context.partition_key)
        check_pool(spec, pool)
        artifacts = store.get()
        mismatch = tokenizer_mismatch(spec, artifacts.read_manifest(checkpoint.uri), source, tokenizer,
                                      artifacts.read_manifest(tokenized.uri))
        if mismatch is not None:
            raise input_refused(f"{key}[{spec.name}]: {mismatch}")

        def build(writer) -> Built:
            out = local_dir(store, writer)
            with tempfile.TemporaryDirectory(prefix="marin-cross-eval-") as scratch:
                config_path = os.path.join(scratch, TRAIN_CONFIG_FILE)
                with artifacts.open(f"{checkpoint.uri}/{TRAIN_CONFIG_FILE}") as src:
                    text = relocated_train_config(src.read().decode("utf-8"), checkpoint.uri, artifacts)
                # A chat cache is read with the template its rows were rendered with: assistant tokens only.
                templates = {source: cache_chat_template(artifacts, tokenized)} if chat else None
                config = validation_only_config(text, {source: tokenized.uri}, templates)
                Path(config_path).write_text(yaml.safe_dump(config, sort_keys=False))
                launcher.run_process(context, eval_command(config_path, out, sample_examples=spec.final_eval_examples,
                                                           extra_args=("--eval-set", source)),
                                     resources=spec.resources.for_evaluation(),
                                     extras={"run": spec.name, "eval_set": source})
            built = eval_built(json.loads((Path(out) / EVAL_REPORT_FILE).read_text()), evaluated_by="eval process")
            built.metadata.update({"run": spec.name, "eval_set": source})
            return built

        return materialize_artifact(context, store, artifact, upstream=[checkpoint, tokenized], build=build)

    return cross_eval


def build_cross_eval_stage(settings: MarinSettings, deployment: Deployment,
                           upstream: Catalog) -> tuple[dg.Definitions, Catalog]:
    """``cross_eval/<source>`` for every source tokenized with a tokenizer some named run uses (no
    run could be scored on the others)."""
    spec_for = named_run_lookup(settings, deployment)
    run_tokenizers = {spec.tokenizer for spec in deployment.runs.values()}
    catalog = Catalog()
    assets = []
    for source, entry in sorted(deployment.tokenization.tokenized.items()):
        if entry.tokenizer in run_tokenizers:
            assets.append(build_cross_eval_asset(source, entry.tokenizer, spec_for=spec_for, pool=settings.train_pool,
                                                 catalog=catalog, checkpoint=upstream.spec("checkpoint"),
                                                 tokenized=upstream.spec(f"tokenized/{source}"),
                                                 chat=entry.cache.chat is not None))
    return dg.Definitions(assets=assets), catalog
