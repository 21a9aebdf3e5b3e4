"""Identity by allow-list (marin_resources/config_identity.py, docs/identity.md): every field of every
config class says whether it defines artifacts, and `config_identity` keeps exactly those that do."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Mapping

import pytest

import marin_assets
import marin_resources
from marin_resources.config_identity import (
    UnclassifiedField,
    config_identity,
    derived,
    identity,
    mark_of,
    runtime,
    unclassified_fields,
)
from marin_resources.typed_config import STRICT, decode, typed_config


def config_classes() -> dict[str, type]:
    """Every config dataclass of the package: each `typed_config` class (a YAML schema) and each
    dataclass that marks any field, by qualified name. Every module is imported (no `__main__`)."""
    found = {}
    for package in (marin_assets, marin_resources):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                if not (isinstance(value, type) and dataclasses.is_dataclass(value)) or value.__module__ != info.name:
                    continue
                schema = value.__dict__.get("__pydantic_config__") is STRICT
                if schema or any(mark_of(f) is not None for f in dataclasses.fields(value)):
                    found[f"{info.name}.{value.__qualname__}"] = value
    return found


def test_every_field_of_every_config_class_is_classified():
    classes = config_classes()
    # The walk finds the configs that identities are made of (it cannot pass by finding none).
    for name in ("training.spec.RunSpec", "training.spec.ModelSpec", "curation.config.SourceConfig",
                 "curation.filters.FilterConfig", "curation.quality.QualityConfig", "curation.dedup_index.DedupConfig",
                 "tokenization.cache_config.CacheConfig", "tokenization.tokenizer.TokenizerConfig",
                 "scaling_sweeps.config.SweepConfig", "evaluation.suites.Suite", "evaluation.suites.HarnessTask",
                 "evaluation.next_line.NextLineTaskSpec"):
        assert f"marin_assets.{name}" in classes, name
    assert "marin_resources.placement.ResourceSpec" in classes
    unmarked = {name: unclassified_fields(cls) for name, cls in sorted(classes.items()) if unclassified_fields(cls)}
    assert not unmarked, ("config fields declared without identity(), runtime() or derived() "
                          f"(docs/identity.md, 'Adding a field'): {unmarked}")


def test_the_walk_reports_a_field_added_without_a_marker():
    """What a forgotten marker looks like to the test above: a new field of a marked config class."""

    @dataclasses.dataclass(frozen=True)
    class Grown:
        size: int = identity(1)
        added: int = 0

    assert unclassified_fields(Grown) == ["added"]
    with pytest.raises(UnclassifiedField, match=r"Grown.added is neither identity nor runtime"):
        config_identity(Grown())


@typed_config
@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float = identity(0.1)
    kind: str = identity("a", omit="default")
    workers: int = runtime(4)


@typed_config
@dataclasses.dataclass(frozen=True)
class Outer:
    name: str = identity()
    inner: Inner = identity(default_factory=Inner)
    stages: tuple[Inner, ...] = identity((), omit="empty")
    weights: Mapping[str, float] | None = identity(None, omit="empty")
    thresholds: Mapping[str, float] = identity(default_factory=dict, scopes=["filtered"])
    blocklist: str | None = derived("filtered/: the sha256 of the file", None)
    region: str = runtime("us")


def test_config_identity_keeps_identity_fields_only():
    assert config_identity(Outer(name="x", region="eu", inner=Inner(workers=64))) == \
        {"name": "x", "inner": {"rate": 0.1}}
    full = Outer(name="x", inner=Inner(kind="b"), stages=(Inner(rate=0.5),), weights={"a": 1.0},
                 thresholds={"t": 0.5}, blocklist="/b.txt")
    assert config_identity(full) == {"name": "x", "inner": {"rate": 0.1, "kind": "b"}, "stages": [{"rate": 0.5}],
                                     "weights": {"a": 1.0}}
    # A scoped field joins the identities of its scope only; derived and runtime fields join none.
    assert config_identity(full, "filtered")["thresholds"] == {"t": 0.5}
    assert "blocklist" not in config_identity(full, "filtered")
    # Empty is omitted as None is: a config that spells out an empty default keeps its identity.
    assert config_identity(Outer(name="x", weights={})) == config_identity(Outer(name="x"))


def test_markers_leave_typed_decoding_as_it_was():
    """The markers are dataclass fields with metadata: the YAML decoder reads defaults, requires fields
    without one, and refuses unknown ones as before."""
    decoded = decode(Outer, {"name": "x", "inner": {"kind": "b"}, "stages": [{"rate": 0.2}]})
    assert decoded == Outer(name="x", inner=Inner(kind="b"), stages=(Inner(rate=0.2),))
    with pytest.raises(ValueError, match="name"):
        decode(Outer, {})


def test_an_identity_field_needs_a_scope():
    with pytest.raises(ValueError, match="needs a scope"):
        identity(1, scopes=[])


@pytest.mark.parametrize("scope", ["quality_threshold", "adopted_classifier"])
def test_a_quality_field_added_to_a_scope_enters_that_artifacts_identity(scope):
    """The keep threshold's and an adopted classifier's identities are read through config_identity
    (under the key names they were first fingerprinted with), so a field marked for their scope is in
    them: the allow-list's one-line change, with no identity function to edit."""
    from marin_assets.curation.config import CurationConfig, SourceConfig
    from marin_assets.curation.model_assets import classifier_identity, threshold_identity
    from marin_assets.curation.quality import QualityConfig

    widened = dataclasses.make_dataclass("WidenedQuality", [("margin", float, identity(0.0, scopes=[scope]))],
                                         bases=(QualityConfig,), frozen=True)
    adopted = {"model_uri": "/m/model.bin", "model_sha256": "a" * 64} if scope == "adopted_classifier" else {}
    source = SourceConfig(name="s", uri="/data/s")
    identity_of = threshold_identity if scope == "quality_threshold" else classifier_identity
    identities = [identity_of(CurationConfig(sources=(source,), quality=widened(margin=margin, **adopted),
                                             quality_sources=("s",)))
                  for margin in (0.0, 0.5)]
    assert identities[0]["margin"] == 0.0 and identities[1]["margin"] == 0.5
