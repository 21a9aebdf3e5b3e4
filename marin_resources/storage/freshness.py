"""Is a stored artifact still the right one? The one staleness rule: the asset code's skip
(`materialize_artifact`), the planner (`marin status`, `marin materialize`, `marin status --why`) and the
data version shown in the UI all come from `decide`.

The identity config is part of the artifact's path, so `existing` is the artifact of exactly the
wanted identity; a config change makes it missing (built beside the old one), never "drifted".
A cause propagates downstream: an artifact whose inputs are stale is stale itself, and its
`Decision` keeps the upstream decision, so the whole chain can be printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from marin_resources.storage.identity import changed_fields
from marin_resources.storage.store import Manifest, UpstreamRef

State = Literal["missing", "fresh", "stale", "damaged"]
# What changed: the data of an input, an identity config, a code version, stored bytes, or an input that
# is itself not fresh.
Kind = Literal["data", "config", "code", "damage", "upstream", "rebuild"]


@dataclass(frozen=True)
class Decision:
    action: Literal["build", "reuse"]
    state: State
    reason: str
    kind: Kind | None = None
    label: str = ""
    # The not-fresh inputs this decision follows from, each with its own causes.
    upstream: tuple[Decision, ...] = field(default_factory=tuple)

    @property
    def never_built(self) -> bool:
        """Missing with no artifact of any config or code version before it: never materialized."""
        return self.state == "missing" and self.kind is None

    def chain(self) -> list[str]:
        """`label: state: reason` for this decision, then for each cause upstream, indented."""
        lines = [f"{self.label}: {self.state}: {self.reason}" if self.label else f"{self.state}: {self.reason}"]
        for cause in self.upstream:
            lines.extend("  " + line for line in cause.chain())
        return lines


def label_of(asset_key: str, partition: str | None) -> str:
    return f"{asset_key}[{partition}]" if partition else asset_key


def decide(existing: Manifest | None, *, config: Any, upstream: list[UpstreamRef],
           damage: list[str] | None = None, previous: Manifest | None = None,
           upstream_decisions: dict[tuple[str, str | None], Decision] | None = None,
           code_version: str | None = None, label: str = "", kept: Manifest | None = None) -> Decision:
    """Reuse when the artifact of this identity is committed, its stored files passed their check
    (`damage` lists what the store's check found wrong), it was built from the data versions its
    inputs have now, and no input is itself stale.

    `upstream`: every input with its current data version. `previous`: the artifact that was current
    before (another config, or another `code_version` than the wanted one), named in the cause when
    this identity is missing. `upstream_decisions`: how fresh each input is, by (asset key, partition),
    when the caller knows (the planner does; an asset run receives inputs that were just built).
    `kept`: the committed artifact of this identity an unfinished rebuild replaces (`find_previous`).
    """
    if existing is None:
        if kept is not None:
            return Decision("build", "stale", "a rebuild has not committed (running, or stopped before its commit); "
                            f"the last committed artifact stays readable at {kept.uri}", "rebuild", label)
        if previous is None:
            return Decision("build", "missing", "never materialized", None, label)
        if code_version is not None and previous.code_version != code_version:
            reason, kind = f"code version changed: {previous.code_version} -> {code_version}", "code"
        else:
            fields = changed_fields(previous.config, config)
            reason, kind = (f"config changed: {', '.join(fields) or 'config'} (the previous config stays at "
                            f"{previous.uri})"), "config"
        return Decision("build", "missing", reason, kind, label)
    if damage:
        return Decision("build", "damaged", damage_summary(damage), "damage", label)
    wanted = {(u.asset_key, u.partition): u.data_version for u in upstream}
    have = existing.upstream_versions()
    if wanted != have:
        return Decision("build", "stale", _upstream_change(wanted, have), "data", label)
    not_fresh = tuple(d for _, d in sorted((upstream_decisions or {}).items(), key=lambda kv: (kv[0][0], str(kv[0][1])))
                      if d.state != "fresh")
    if not_fresh:
        names = ", ".join(f"{d.label} is {d.state}" for d in not_fresh)
        return Decision("build", "stale", f"upstream {names}", "upstream", label, not_fresh)
    return Decision("reuse", "fresh", "artifact, identity and upstream data versions match", None, label)


def _upstream_change(wanted: dict, have: dict) -> str:
    """`upstream raw/x[a] changed (data)`, or which input partitions were added or removed."""
    parts = []
    changed = sorted(k for k in set(wanted) & set(have) if wanted[k] != have[k])
    if changed:
        parts.append("upstream " + ", ".join(label_of(*k) for k in changed) + " changed (data)")
    for title, keys in (("new", set(wanted) - set(have)), ("gone", set(have) - set(wanted))):
        if keys:
            parts.append(f"upstream {title}: " + ", ".join(sorted(label_of(*k) for k in keys)))
    return "; ".join(parts)


def damage_summary(problems: list[str], shown: int = 3) -> str:
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return "damaged: " + "; ".join(problems[:shown]) + more
