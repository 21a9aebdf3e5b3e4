"""Keep secrets out of metadata, manifests and logs.

Secrets reach training processes through environment variables or Kubernetes secret
references. As a second line of defence, everything we persist (manifest config, metrics,
producer info, Dagster metadata) is scrubbed of the current values of known secret variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

SECRET_ENV_VARS = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY",
                   "AWS_SESSION_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS_JSON", "DAGSTER_PG_PASSWORD",
                   "RAY_AUTH_TOKEN")
REDACTED = "***"
_MIN_SECRET_LEN = 6  # shorter values would redact ordinary words


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    return sorted({v for k in SECRET_ENV_VARS if len(v := env.get(k, "")) >= _MIN_SECRET_LEN}, key=len, reverse=True)


def scrub(value: Any, secrets: list[str] | None = None) -> Any:
    """Replace any occurrence of a secret value inside strings, recursively."""
    secrets = secret_values() if secrets is None else secrets
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, Mapping):
        return {k: scrub(v, secrets) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(scrub(v, secrets) for v in value)
    data = getattr(value, "data", None)  # dg.MetadataValue.json / .md / .text carry their payload in .data/.text
    if data is not None and type(value).__name__ == "JsonMetadataValue":
        return type(value)(scrub(data, secrets))
    text = getattr(value, "text", None) or getattr(value, "md_str", None)
    if isinstance(text, str) and any(s in text for s in secrets):
        return REDACTED
    return value
