"""The user's project file, `marin.yaml`: what a project adds to the built-in sources, tokenizers,
mixtures, runs and sweeps, and where its store is.

Which file: the one `MARIN_CONFIG` names (the CLI's `--config PATH` sets it), else `marin.yaml` in
the working directory, else none. `MarinSettings.from_env` finds and reads it once, so the CLI, its
run workers and `marin ui` started in the same directory all see the same project.

The file's top level is checked here (known sections, each of the right type, the store a string);
each section is then validated strictly by the stage that owns it, on top of the built-in config
(`marin_assets.deployment.Deployment.load`). The store is a runtime choice: it never enters an
artifact's identity, while the other sections define artifacts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marin_resources.typed_config import ConfigError, read_yaml

PROJECT_FILE = "marin.yaml"
CONFIG_ENV = "MARIN_CONFIG"
CURATION_SECTIONS = ("filters", "sources", "quality", "language_id")
REGISTRY_SECTIONS = ("tokenizers", "tokenized", "default", "mixtures", "decontamination")
EVAL_SUITES_SECTION = "eval_suites"
SECTION_TYPES: dict[str, type] = {"store": str, "filters": Mapping, "sources": list, "quality": Mapping,
                                  "language_id": Mapping, "tokenizers": Mapping, "tokenized": Mapping,
                                  "default": Mapping, "mixtures": Mapping, "decontamination": Mapping,
                                  "runs": Mapping, "sft_runs": Mapping, "sweeps": Mapping, "mixture_sweeps": Mapping,
                                  EVAL_SUITES_SECTION: Mapping}
_TYPE_NAMES = {str: "a string", Mapping: "a mapping", list: "a list"}


class ProjectFileError(ConfigError):
    """The project file is missing, unreadable or malformed; the message names the file and the key."""


@dataclass(frozen=True)
class ProjectFile:
    path: Path
    """Absolute path of the file; relative paths inside it resolve against its directory."""
    store: str | None
    """The store prefix it names (a local path made absolute, or a URL); None: not named."""
    sections: Mapping[str, Any]
    """Every other section as parsed YAML, validated by the config that owns it."""

    @property
    def directory(self) -> Path:
        return self.path.parent

    def part(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The sections among ``names`` that the file sets."""
        return {name: self.sections[name] for name in names if name in self.sections}


def find_project_file(environ: Mapping[str, str], cwd: Path) -> Path | None:
    """`MARIN_CONFIG` (which must exist), else `marin.yaml` in ``cwd`` if there is one."""
    named = environ.get(CONFIG_ENV)
    if named:
        path = (cwd / Path(named).expanduser()).resolve()
        if not path.is_file():
            raise ProjectFileError(f"{CONFIG_ENV}={named}: no such project file")
        return path
    found = cwd / PROJECT_FILE
    return found.resolve() if found.is_file() else None


def load_project_file(path: Path) -> ProjectFile:
    """The project file at ``path``, its top level checked: known sections of the right types."""
    data = read_yaml(path, "project file", ProjectFileError)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ProjectFileError(f"{path}: the top level must be a mapping of sections "
                               f"({', '.join(SECTION_TYPES)}), got {type(data).__name__}")
    for key, value in data.items():
        expected = SECTION_TYPES.get(key)
        if expected is None:
            raise ProjectFileError(f"{path}: unknown key {key!r} (allowed: {', '.join(SECTION_TYPES)})")
        if value is not None and not isinstance(value, expected):
            raise ProjectFileError(f"{path}: {key}: expected {_TYPE_NAMES[expected]}, got {value!r} "
                                   f"({type(value).__name__})")
    store = data.get("store")
    if store is not None and not store.strip():
        raise ProjectFileError(f"{path}: store: must not be empty")
    if store is not None and "://" not in store:
        store = str((path.parent / Path(store).expanduser()).resolve())
    sections = {k: v for k, v in data.items() if k != "store" and v is not None}
    return ProjectFile(path=path, store=store, sections=sections)
