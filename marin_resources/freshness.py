"""Is a stored artifact still the right one? Shared by the skip logic and `marin status`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from marin_resources.identity import changed_fields
from marin_resources.store import Manifest, UpstreamRef


class FingerprintDriftError(RuntimeError):
    """Same code version, different identity config, and strict fingerprints are on."""


@dataclass(frozen=True)
class Decision:
    action: Literal["build", "reuse"]
    state: Literal["missing", "fresh", "stale", "drift", "damaged"]
    reason: str
    drift_fields: list[str] = field(default_factory=list)


def decide(existing: Manifest | None, *, fingerprint: str, config: Any, upstream: list[UpstreamRef],
           strict: bool = False, damage: list[str] | None = None) -> Decision:
    """Reuse when artifact, code version, fingerprint and upstream data versions all match, and the
    stored files passed their check (`damage` lists what the store's check found wrong).

    Code version is part of the location, so `existing` is already the manifest for the
    current code version. Same code version with another fingerprint is drift: Marin's
    default is to keep the artifact and say so loudly; strict mode refuses.
    """
    if existing is None:
        return Decision("build", "missing", "no committed artifact at this code version")
    if damage:
        return Decision("build", "damaged", damage_summary(damage))
    wanted = {(u.asset_key, u.partition): u.data_version for u in upstream}
    have = existing.upstream_versions()
    if wanted != have:
        changed = sorted(f"{k[0]}[{k[1]}]" if k[1] else k[0]
                         for k in set(wanted) | set(have) if wanted.get(k) != have.get(k))
        return Decision("build", "stale", "upstream data changed: " + ", ".join(changed))
    if existing.fingerprint != fingerprint:
        fields = changed_fields(existing.config, config)
        message = f"config drift at code version {existing.code_version}: changed {', '.join(fields) or 'config'}"
        if strict:
            raise FingerprintDriftError(message + " (strict fingerprints: bump the code version or revert)")
        return Decision("reuse", "drift", message, fields)
    return Decision("reuse", "fresh", "artifact, code version, fingerprint and upstream data versions match")


def damage_summary(problems: list[str], shown: int = 3) -> str:
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return "damaged: " + "; ".join(problems[:shown]) + more
