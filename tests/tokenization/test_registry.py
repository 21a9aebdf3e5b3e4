"""The tokenization registry: a default tokenized/<source> for every curated source, MARIN_REGISTRY,
and clear errors for bad entries. Loads definitions only; nothing is materialized."""

from __future__ import annotations

import pytest

from marin_assets.definitions import build_definitions
from marin_assets.deployment import Deployment
from marin_assets.tokenization.assets import RegistryError, load_registry
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
])
def test_bad_registry_is_rejected(tmp_path, text, message):
    path = tmp_path / "registry.yaml"
    path.write_text(text)
    with pytest.raises(RegistryError, match=message):
        load_registry(path)


def test_missing_registry_file_says_where(tmp_path):
    with pytest.raises(RegistryError, match="MARIN_REGISTRY"):
        load_registry(tmp_path / "absent.yaml")
