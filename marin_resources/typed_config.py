"""One typed decoder for the YAML configs (sources, tokenization registry, runs, sweeps).

pydantic validates plain data (a parsed YAML mapping) against our frozen config dataclasses:
strictly, with JSON's types (an integer field refuses ``"10"`` and ``true``, a number field takes
an integer, a tuple field takes a list), and unknown fields are refused. No number is NaN or
infinite (YAML's ``.nan``, ``.inf``): no field of any config means anything by one. The first problem comes
back as a `FieldProblem`: the dotted path of the field and a sentence naming what was wrong,
which each config's own error type wraps with the source, run or sweep it belongs to.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

STRICT = ConfigDict(extra="forbid", strict=True)
T = typing.TypeVar("T")


def typed_config(cls: type[T]) -> type[T]:
    """Class decorator: decode this dataclass strictly and refuse unknown fields."""
    cls.__pydantic_config__ = STRICT  # type: ignore[attr-defined]
    return cls


class ConfigError(ValueError):
    """A configuration file or setting is invalid; the message says which one and what is wrong.
    The CLI refuses it in one line (exit 2), so each config's error type derives from this."""


class FieldProblem(ValueError):
    """A config value at ``path`` (field names and list indices) is wrong; ``unknown`` when the
    field itself does not exist (the last path element names it)."""

    def __init__(self, path: tuple[str | int, ...], problem: str, *, unknown: bool = False):
        self.path, self.problem, self.unknown = path, problem, unknown
        super().__init__(f"{self.dotted or '<config>'}: {problem}")

    @property
    def dotted(self) -> str:
        return dotted(self.path)

    @property
    def parent(self) -> str:
        """Where an unknown field was found (empty at the top level)."""
        return dotted(self.path[:-1])


def dotted(path: tuple[str | int, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def read_yaml(path: Path, what: str, error: type[ConfigError] = ConfigError) -> Any:
    """The parsed YAML document at ``path``; ``error`` in one line naming the file otherwise."""
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None


@functools.cache
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp)


def decode(tp: type[T] | Any, raw: Any) -> T:
    """``raw`` as an instance of ``tp`` (a `typed_config` dataclass, or a type such as
    ``tuple[str, ...]``); raises `FieldProblem` naming the first wrong field."""
    not_finite = _first_non_finite(raw, ())
    if not_finite is not None:
        raise not_finite
    try:
        text = json.dumps(raw, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise FieldProblem((), f"not plain data: {exc}") from None
    try:
        return _adapter(tp).validate_json(text)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise _union_problem(tp, errors) or _problem(tp, errors[0]) from None


def _first_non_finite(raw: Any, path: tuple[str | int, ...]) -> FieldProblem | None:
    if isinstance(raw, float) and not math.isfinite(raw):
        return FieldProblem(path, f"expected a finite number, got {raw}")
    items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(raw, (list, tuple)) else ()
    for key, value in items:
        problem = _first_non_finite(value, (*path, key if isinstance(key, (str, int)) else str(key)))
        if problem is not None:
            return problem
    return None


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _problem(tp: Any, error: dict[str, Any]) -> FieldProblem:
    path = tuple(p for p in error["loc"] if isinstance(p, (str, int)))
    kind, value = error["type"], error.get("input")
    if kind == "unexpected_keyword_argument":
        known = sorted(f.name for f in dataclasses.fields(_class_at(tp, path[:-1])))
        return FieldProblem(path, f"unknown field {path[-1]!r} (known: {', '.join(known)})", unknown=True)
    if kind in ("missing", "missing_argument"):
        return FieldProblem(path, "required field is missing")
    if kind == "literal_error":
        return FieldProblem(path, f"{value!r} is not one of {error['ctx']['expected']}")
    expected = EXPECTED.get(kind)
    if expected is not None:
        return FieldProblem(path, f"expected {expected}, got {_describe(value)}")
    message = error["msg"].removeprefix("Value error, ")
    return FieldProblem(path, message)


EXPECTED = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
            "float_type": "a number", "float_parsing": "a number", "bool_type": "a boolean",
            "bool_parsing": "a boolean", "string_type": "a string", "list_type": "a list",
            "tuple_type": "a list", "dataclass_type": "a mapping", "dict_type": "a mapping",
            "mapping_type": "a mapping", "finite_number": "a finite number"}


def _union_problem(tp: Any, errors: list[dict[str, Any]]) -> FieldProblem | None:
    """A value that matches no member of a union field (``bool | Literal["auto"]``): pydantic reports
    each member's error under the field's path plus the member's tag; one problem names them all."""
    path = tuple(p for p in errors[0]["loc"] if isinstance(p, (str, int)))
    depth = _union_depth(tp, path)
    if depth is None:
        return None
    members = [e for e in errors if tuple(e["loc"][:depth]) == path[:depth] and len(e["loc"]) == depth + 1]
    if len(members) < 2:
        return None
    expected = []
    for error in members:
        if error["type"] == "literal_error":
            expected.append(error["ctx"]["expected"])
        else:
            expected.append(EXPECTED.get(error["type"], error["msg"]))
    if type(None) in typing.get_args(_field_type(tp, path[:depth])):
        expected.append("null")
    return FieldProblem(path[:depth], f"expected {', '.join(expected[:-1])} or {expected[-1]}, got "
                                      f"{_describe(errors[0].get('input'))}")


def _field_type(tp: Any, path: tuple[str | int, ...]) -> Any:
    """The annotation of the field at ``path`` (field names and list indices) inside the dataclass ``tp``."""
    for part in path:
        if isinstance(part, int):
            tp = next(a for a in typing.get_args(tp) if a is not Ellipsis)
            continue
        holder = tp
        if typing.get_origin(holder) in (typing.Union, types.UnionType):
            holder = next(a for a in typing.get_args(holder) if a is not type(None))
        if not dataclasses.is_dataclass(holder):
            return None
        tp = typing.get_type_hints(holder)[part]
    return tp


def _union_depth(tp: Any, path: tuple[str | int, ...]) -> int | None:
    """How many elements of ``path`` lead to a field whose type is a union of two or more non-null types."""
    for depth in range(1, len(path)):
        field_type = _field_type(tp, path[:depth])
        if field_type is None:
            return None
        if typing.get_origin(field_type) in (typing.Union, types.UnionType) and \
                len([a for a in typing.get_args(field_type) if a is not type(None)]) > 1:
            return depth
    return None


def _class_at(tp: Any, path: tuple[str | int, ...]) -> Any:
    """The dataclass that holds the field at ``path`` inside ``tp``."""
    for part in path:
        if isinstance(part, int):
            tp = next(a for a in typing.get_args(tp) if a is not Ellipsis)
            continue
        tp = typing.get_type_hints(tp)[part]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


BASE_FIELD = "base"
"""The field by which a run or sweep names the entry it is declared as a difference from."""


def resolve_bases(raw: typing.Mapping[str, Any], existing: typing.Mapping[str, Any],
                  refuse: typing.Callable[[str, str, str], ConfigError]) -> dict[str, Any]:
    """The entries of ``raw`` ({name: body}) with every ``base: NAME`` replaced by that entry's
    resolved body, this entry's fields on top: a mapping merges field by field (``model:
    {num_layers: 4}`` changes one field of the base's model), anything else replaces the base's
    value (``null`` included). A base is another entry of ``raw`` or, failing that, of ``existing``
    (config dataclasses already resolved: the built-ins); an entry may name its own name to derive
    from the ``existing`` one it replaces. An unknown base or a loop raises ``refuse(entry, "base",
    problem)``, the config's own error."""
    resolved: dict[str, Any] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> Any:
        if name in resolved:
            return resolved[name]
        body = raw[name]
        if not isinstance(body, typing.Mapping) or BASE_FIELD not in body:
            resolved[name] = body
            return body
        base = body[BASE_FIELD]
        if not isinstance(base, str) or not base:
            raise refuse(name, BASE_FIELD, f"expected the name of another entry, got {base!r}")
        if base in existing and (base == name or base not in raw):
            inherited = {k: v for k, v in dataclasses.asdict(existing[base]).items() if k != "name"}
        elif base in chain:
            raise refuse(chain[0], BASE_FIELD, f"bases form a loop: {' -> '.join([*chain, base])}")
        elif base in raw:
            inherited = resolve(base, (*chain, base))
        else:
            known = sorted({*raw, *existing} - {name})
            raise refuse(name, BASE_FIELD, f"no entry named {base!r} to derive from (known: {', '.join(known)})")
        if not isinstance(inherited, typing.Mapping):
            raise refuse(name, BASE_FIELD, f"{base!r} is not a mapping of fields to derive from")
        resolved[name] = merged_fields(inherited, {k: v for k, v in body.items() if k != BASE_FIELD})
        return resolved[name]

    return {name: resolve(name, (name,)) for name in raw}


def merged_fields(base: typing.Mapping[str, Any], override: typing.Mapping[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``: nested mappings merge, any other value replaces."""
    out = dict(base)
    for key, value in override.items():
        old = out.get(key)
        both_mappings = isinstance(value, typing.Mapping) and isinstance(old, typing.Mapping)
        out[key] = merged_fields(old, value) if both_mappings else value
    return out
