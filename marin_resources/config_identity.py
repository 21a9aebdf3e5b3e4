"""Identity by allow-list: each config field says, where it is declared, whether it defines the
artifacts built from it, and `config_identity` keeps exactly the fields that do.

A config dataclass declares every field with one of three markers (as Marin's ``versioned()`` marks
the values of a step's config that enter its version):

- ``identity()``: part of the identity of what is built from the config. ``scopes`` limits it to
  the named identities only (a source's ``filters`` define its filtered documents and the quality
  classifier trained on it, not its raw bytes); ``omit`` leaves it out while it holds its default
  (``"default"``) or is None or empty (``"empty"``), for a field added after artifacts were first
  fingerprinted, so that they keep their fingerprints.
- ``runtime()``: where or how a build runs (resources, batch sizes, logging); in no identity.
- ``derived(how)``: enters identities only as something computed from it, which ``how`` names (the
  sha256 of the file a path names, say); `config_identity` leaves it out.

A field without a marker is refused by `config_identity`, and `unclassified_fields` lists them for
the test that walks every config class (tests/foundation/test_config_identity.py): adding a field
means deciding, where it is declared, whether it changes results. docs/identity.md explains it.

Pure: no Dagster import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from marin_resources.storage.identity import to_jsonable

MARK = "marin/identity"
EVERY = "every"
"""The scope of an identity field that belongs to every identity of its config."""
Omit = Literal["default", "empty"]


@dataclasses.dataclass(frozen=True)
class Mark:
    kind: Literal["identity", "runtime", "derived"]
    scopes: tuple[str, ...] = (EVERY,)
    omit: Omit | None = None
    how: str = ""


def _field(mark: Mark, default: Any, default_factory: Any, **kwargs: Any) -> Any:
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={**kwargs.pop("metadata", {}), MARK: mark}, **kwargs)


def identity(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
             scopes: Iterable[str] = (EVERY,), omit: Omit | None = None, **kwargs: Any) -> Any:
    """A field that defines the artifacts built from its config (in the named ``scopes`` only, where given)."""
    scopes = tuple(scopes)
    if not scopes:
        raise ValueError("an identity field needs a scope (EVERY, or the identities it belongs to)")
    return _field(Mark("identity", scopes, omit), default, default_factory, **kwargs)


def runtime(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A field that says where or how a build runs, never what it produces: in no identity."""
    return _field(Mark("runtime"), default, default_factory, **kwargs)


def derived(how: str, default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            **kwargs: Any) -> Any:
    """A field whose value enters identities only as ``how`` computes it from it (never as it stands)."""
    return _field(Mark("derived", how=how), default, default_factory, **kwargs)


def mark_of(f: dataclasses.Field) -> Mark | None:
    return f.metadata.get(MARK)


class UnclassifiedField(TypeError):
    """A config field without an identity marker reached `config_identity`."""


def _omitted(f: dataclasses.Field, mark: Mark, value: Any) -> bool:
    if mark.omit == "empty":
        return value is None or (isinstance(value, (Mapping, tuple, list, str)) and not value)
    if mark.omit == "default":
        if f.default is not dataclasses.MISSING:
            return value == f.default
        return f.default_factory is not dataclasses.MISSING and value == f.default_factory()
    return False


def config_identity(config: Any, scope: str = EVERY) -> Any:
    """The identity of ``config`` as plain JSON data: of each dataclass (nested ones, and those in
    tuples and mappings, too) the fields marked ``identity`` for ``scope`` (those of every scope, and
    those naming ``scope``), less those their ``omit`` leaves out now. Raises `UnclassifiedField`
    on a field without a marker."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        out = {}
        for f in dataclasses.fields(config):
            mark = mark_of(f)
            if mark is None:
                raise UnclassifiedField(f"{type(config).__qualname__}.{f.name} is neither identity nor runtime: "
                                        "declare it with identity(), runtime() or derived() (docs/identity.md)")
            value = getattr(config, f.name)
            if mark.kind != "identity" or not (EVERY in mark.scopes or scope in mark.scopes) \
                    or _omitted(f, mark, value):
                continue
            out[f.name] = config_identity(value, scope)
        return out
    if isinstance(config, Mapping):
        return {str(k): config_identity(v, scope) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [config_identity(v, scope) for v in config]
    return to_jsonable(config)


def unclassified_fields(cls: type) -> list[str]:
    """The fields of dataclass ``cls`` declared without an identity marker."""
    return [f.name for f in dataclasses.fields(cls) if mark_of(f) is None]
