"""Every artifact keeps its identity: the fingerprints of the demo graph (every asset and partition the
bundled configs declare) and of configs that set each optional identity field are the ones recorded in
`identities.golden.json`. A change of how identities are computed that moves any of them fails here, so
it must either keep them or come with `marin migrate` (docs/identity.md).

Regenerate the file only for a deliberate identity change:
``python tests/foundation/test_identity_golden.py --write``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import dagster as dg

from marin_resources.storage.identity import canonical_json, fingerprint

GOLDEN = Path(__file__).with_name("identities.golden.json")


def _entry(config: Any) -> dict[str, Any]:
    return {"fingerprint": None if config is None else fingerprint(config),
            "identity": None if config is None else json.loads(canonical_json(config))}


def graph_identities(tmp: Path) -> dict[str, Any]:
    """Each artifact spec of the code location built from the bundled configs: its code identity, and
    the identity of each of its partitions (dynamic ones as their discoverer lists them now)."""
    from marin_assets.definitions import build_definitions
    from marin_assets.planning import parse_key
    from marin_resources.environments import MarinSettings

    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp / "store")}, cwd=tmp)
    defs, catalog = build_definitions(settings)
    graph = defs.resolve_asset_graph()
    out: dict[str, Any] = {}
    for key, spec in sorted(catalog.specs.items()):
        pdef = graph.get(parse_key(key)).partitions_def
        if pdef is None:
            partitions: list[str | None] = [None]
        elif isinstance(pdef, dg.DynamicPartitionsDefinition):
            partitions = sorted(catalog.discoverers[pdef.name]())
        else:
            partitions = sorted(pdef.get_partition_keys())
        out[key] = {"version": spec.version, "code_identity": _entry(spec.code_identity),
                    "partitions": {str(p): _entry(spec.identity(p)) for p in partitions}}
    return out


def variant_identities() -> dict[str, Any]:
    """Identities of configs that set the optional fields the demo leaves at their defaults, each
    through the function its artifact computes it with."""
    from marin_assets.curation.config import CurationConfig, SourceConfig, reading_identity
    from marin_assets.curation.filters import FilterConfig
    from marin_assets.curation.model_assets import classifier_identity
    from marin_assets.curation.pii import PiiConfig
    from marin_assets.curation.quality import QualityConfig
    from marin_assets.evaluation.cross_eval import cross_eval_identity
    from marin_assets.evaluation.suites import HarnessTask, Suite
    from marin_assets.export.assets import ExportConfig, export_identity
    from marin_assets.scaling_sweeps.config import load_sweeps
    from marin_assets.tokenization.cache_config import CacheConfig
    from marin_assets.training.spec import (
        ComputeSpec,
        Cooldown,
        InitFrom,
        MixtureStage,
        ParallelismSpec,
        load_run_registry,
    )
    from marin_resources.config_identity import config_identity
    from marin_resources.placement import ResourceSpec

    replace = dataclasses.replace
    run = load_run_registry()["nano-shakespeare"]
    families = FilterConfig(families={"c4": {}, "fineweb": {"max_short_line_ratio": 0.5}})
    source = SourceConfig(name="s", uri="/data/s", format="jsonl", text_field="body", id_field="id",
                          bytes_per_shard=None, files_per_shard=2, max_doc_bytes=1000, strip_gutenberg=False,
                          expand_archives=False, follow_symlinks=True, sha256="0" * 64, filters=families,
                          dedup={"mode": "exact"}, pii=PiiConfig(), url_blocklist="/data/blocked.txt")
    quality = QualityConfig(keep_fraction=0.5, score_max_chars=None, epoch=3)
    adopted = QualityConfig(model_uri="/m/model.bin", model_sha256="a" * 64)
    curation = CurationConfig(sources=(source,), quality=quality, quality_positive_sources=(source,),
                              quality_negative_sources=(replace(source, name="n", filters=FilterConfig()),))
    mixtral = replace(run, model=replace(run.model, family="mixtral", num_experts=4, experts_per_token=2),
                      optimizer=replace(run.optimizer, type="lion"))
    runtime = replace(run, resources=ResourceSpec(device_count=2), parallelism=ParallelismSpec(fsdp=2),
                      compute=ComputeSpec(gradient_checkpointing=True, attention="vanilla"), watch_every=0)
    sampled = replace(run, final_eval_examples=64)
    mixed = replace(run, mixture_weights={"shakespeare": 1.0},
                    mixture_schedule=(MixtureStage(step=10, weights={"shakespeare": 0.5}),))
    cooled = replace(run, cooldown=Cooldown(run="base", step=99))
    initialized = replace(run, init_from=InitFrom(path="hf://org/model"))
    cache = CacheConfig(validation_min_documents=5, batch_rows=7)
    sweep = load_sweeps()["demo"]
    sweep_variant = replace(sweep, metric="eval/shakespeare/bpb", eval_examples=32, watch_every=0,
                            target_recipe_overrides={"min_tokens_per_param": 5.0})
    suite = Suite(name="s", description="d", tasks=(HarnessTask(task="t", num_fewshot=2, limit=5, alias="a",
                                                                 hard=True),), bpb=("x",), needs_hub=True)
    return {
        "reading_identity/every_field": _entry(reading_identity(source)),
        "filter_identity/families": _entry(config_identity(families)),
        "filter_identity/default": _entry(config_identity(FilterConfig())),
        "classifier_identity/trained": _entry(classifier_identity(curation)),
        "classifier_identity/adopted": _entry(classifier_identity(replace(curation, quality=adopted))),
        "run/mixtral_lion": _entry(mixtral.identity()),
        "run/runtime_fields_set": _entry(runtime.identity()),
        "run/mixture_weights_and_schedule": _entry(mixed.identity()),
        "run/cooldown": _entry(cooled.identity()),
        "run/cooldown_with_base": _entry(cooled.identity(cooldown_base="f" * 64)),
        "run/init_from": _entry(initialized.identity()),
        "run/init_from_with_weights": _entry(initialized.identity(init_weights="e" * 64)),
        "eval/whole_split": _entry(run.eval_identity()),
        "eval/sampled": _entry(sampled.eval_identity()),
        "cross_eval/sampled": _entry(cross_eval_identity(sampled, "shakespeare")),
        "export/step": _entry(export_identity(run, ExportConfig(step=10, max_shard_mb=5))),
        "cache/default": _entry({"identity": CacheConfig().identity(), "rows": CacheConfig().row_identity(),
                                 "encoding": CacheConfig().encoding_identity()}),
        "cache/minimum": _entry({"identity": cache.identity(), "rows": cache.row_identity(),
                                 "encoding": cache.encoding_identity()}),
        "sweep/metric_and_target_overrides": _entry(sweep_variant.identity()),
        "suite/every_field": _entry(suite.identity()),
    }


def current_identities(tmp: Path) -> dict[str, Any]:
    return {"graph": graph_identities(tmp), "variants": variant_identities()}


def render(identities: dict[str, Any]) -> str:
    return json.dumps(identities, sort_keys=True, indent=1) + "\n"


def test_every_identity_is_the_recorded_one(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    current = json.loads(render(current_identities(tmp_path)))
    moved = []
    for section in ("graph", "variants"):
        assert sorted(current[section]) == sorted(golden[section]), f"{section}: other artifacts or variants"
        for name, entry in golden[section].items():
            if current[section][name] != entry:
                moved.append(f"{section}/{name}")
    assert not moved, f"identities changed (their artifacts would be rebuilt): {moved}"
    assert render(current) == GOLDEN.read_text()


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/foundation/test_identity_golden.py --write")
    with tempfile.TemporaryDirectory() as tmp:
        GOLDEN.write_text(render(current_identities(Path(tmp))))
    print(f"wrote {GOLDEN}")
