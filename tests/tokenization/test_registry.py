"""The tokenization registry: a default tokenized/<source> for every curated source, MARIN_REGISTRY,
and clear errors for bad entries. Loads definitions only; nothing is materialized."""

from __future__ import annotations

import pytest

from marin_assets.definitions import build_definitions
from marin_assets.deployment import Deployment
from marin_assets.tokenization.registry import RegistryError, load_registry
from marin_resources.environments import MarinSettings
from marin_resources.keys import marin_key

REGISTRY = """
tokenizers:
  letters_bpe: {train_on: [letters], vocab_size: 512, version: v7}
default: {tokenizer: letters_bpe, validation_fraction: 0.05}
tokenized:
  notes: {tokenizer: letters_bpe, validation_fraction: 0.5}
mixtures:
  letters: {tokenizer: letters_bpe, components: {letters: {weight: 1.0}, notes: {weight: 0.0}}}
"""


@pytest.fixture
def sources(tmp_path):
    path = tmp_path / "sources.yaml"
    path.write_text("sources:\n"
                    f"  - {{name: letters, uri: {tmp_path}/letters/*.txt, format: text}}\n"
                    f"  - {{name: notes, uri: {tmp_path}/notes/*.txt, format: text}}\n"
                    f"  - {{name: memos, uri: {tmp_path}/memos/*.txt, format: text}}\n")
    return path


def _tokenization_keys(settings: MarinSettings) -> set[str]:
    defs, _ = build_definitions(settings)
    return {marin_key(k) for k in defs.resolve_asset_graph().get_all_asset_keys()
            if k.path[0] in ("tokenizer", "tokenized", "mixture")}


def test_bundled_registry_tokenizes_every_curated_source():
    settings = MarinSettings.from_env({})
    deployment = Deployment.load(settings)
    registry = deployment.tokenization
    assert set(registry.tokenized) == deployment.source_names == {"shakespeare", "installed_packages"}
    # The source's own entry wins over the default.
    assert registry.tokenized["shakespeare"].cache.validation_fraction == 0.1
    assert registry.tokenized["installed_packages"].tokenizer == "shakespeare"
    assert registry.tokenized["installed_packages"].cache.validation_fraction == 0.01
    # A new source holds out at least 10 documents; shakespeare's own entry keeps its identity as it was.
    assert registry.tokenized["installed_packages"].cache.validation_min_documents == 10
    assert "validation_min_documents" not in registry.tokenized["shakespeare"].cache.identity()
    assert {"tokenized/shakespeare", "tokenized/installed_packages"} <= _tokenization_keys(settings)


def test_marin_registry_replaces_the_bundled_file(tmp_path, sources):
    registry = tmp_path / "registry.yaml"
    registry.write_text(REGISTRY)
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SOURCES": str(sources),
                                       "MARIN_REGISTRY": str(registry)})
    assert settings.registry_file == str(registry)
    assert _tokenization_keys(settings) == {"tokenizer/letters_bpe", "tokenized/letters", "tokenized/notes",
                                            "tokenized/memos", "mixture/letters"}
    resolved = Deployment.load(settings).tokenization
    assert resolved.tokenizers["letters_bpe"].version == "v7"
    assert resolved.tokenized["memos"].cache.validation_fraction == 0.05
    assert resolved.tokenized["notes"].cache.validation_fraction == 0.5

    # Without MARIN_REGISTRY the bundled registry applies: its tokenizer needs `shakespeare`, which
    # these sources lack, so nothing is tokenized here.
    bundled = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SOURCES": str(sources)})
    assert _tokenization_keys(bundled) == set()


@pytest.mark.parametrize("text, message", [
    ("tokenizers: {}\ndefault: {tokenizer: nope}\n", "default: tokenizer 'nope' is not declared"),
    ("tokenizers: {t: {train_on: [a], version: ../x}}\n", "not a valid path segment"),
    ("tokenizer: {}\n", "unknown section"),
    ("tokenizers: {t: {train_on: [a]}}\ndefault: {tokenizer: t, validation_fractoin: 0.1}\n", "unknown field"),
    ("tokenizers: {t: {train_on: [a]}}\ndefault: {tokenizer: t, validation_floor: {docs: 3}}\n",
     "default.validation_floor: field 'docs'"),
    ("tokenizers: {t: {train_on: [a]}}\ndefault: {tokenizer: t, validation_floor: {tokens: -1}}\n",
     "documents and tokens must be >= 0"),
    ("tokenizers: {t: {train_on: [a]}}\ndefault: {tokenizer: t, validation_min_documents: 0}\n",
     "validation_min_documents must be at least 1"),
    # Names Dagster refuses as tag values: they crashed the code location with a stack trace.
    ("tokenizers: {t: {train_on: [a]}}\nmixtures: {text+code: {tokenizer: t, components: {a: {}}}}\n",
     r"mixture 'text\+code': not a safe name \(letters, digits"),
    ("tokenizers: {'t t': {train_on: [a]}}\n", "tokenizer 't t': not a safe name"),
    (f"tokenizers: {{t: {{train_on: [a]}}}}\nmixtures: {{{'m' * 64}: {{tokenizer: t, components: {{a: {{}}}}}}}}\n",
     "at most 63 characters"),
])
def test_bad_registry_is_rejected(tmp_path, text, message):
    path = tmp_path / "registry.yaml"
    path.write_text(text)
    with pytest.raises(RegistryError, match=message):
        load_registry(path)


def test_missing_registry_file_says_where(tmp_path):
    with pytest.raises(RegistryError, match="MARIN_REGISTRY"):
        load_registry(tmp_path / "absent.yaml")


def test_a_small_validation_split_is_a_warning_that_says_what_to_set(tmp_path):
    import dagster as dg

    from marin_assets.tokenization.assets import ValidationFloor, validation_size_result

    path = tmp_path / "registry.yaml"
    path.write_text("tokenizers: {t: {train_on: [a]}}\n"
                    "tokenized: {a: {tokenizer: t, validation_floor: {documents: 3, tokens: 1000}}}\n")
    entry = load_registry(path).tokenized["a"]
    assert entry.validation_floor == ValidationFloor(documents=3, tokens=1000)
    small = validation_size_result({"validation_documents": 1, "validation_tokens": 218}, entry.validation_floor,
                                   entry.cache)
    assert not small.passed and small.severity == dg.AssetCheckSeverity.WARN
    assert small.description == ("1 validation document(s) < 3; 218 validation tokens < 1,000; raise "
                                 "validation_fraction (0.01) or set validation_min_documents in the tokenization "
                                 "registry")
    assert validation_size_result({"validation_documents": 3, "validation_tokens": 1000}, entry.validation_floor,
                                  entry.cache).passed
