"""S3 and GCS endpoints, credentials checks and retries for every client that touches the store.

Three clients read and write artifacts: fsspec (s3fs, gcsfs) for manifests and files, and
tensorstore, through JAX's spec builder, for Levanter's token caches and checkpoints. Endpoints
come from the standard variables only:

- S3: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (botocore reads both itself);
- GCS: ``STORAGE_EMULATOR_HOST`` (gcsfs reads it itself; tensorstore's name for it is
  ``TENSORSTORE_GCS_HTTP_URL``, derived here).

``install_tensorstore_paths`` adds the storage retry policy to tensorstore's S3 and GCS specs and
fixes two faults of JAX 0.7's ``get_tensorstore_spec`` on ``s3://``:
its scheme regex ``[a-z]+`` does not match ``s3``, so ``s3://b/x`` became the local relative path
``s3:/b/x`` (Levanter then wrote token caches into ``./s3:/`` and the bucket held only ledgers),
and its S3 kvstore carries no ``endpoint``. JAX/Levanter are imported only when it is called, in
the training/eval process or inside an asset that writes a Levanter cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from marin_resources.storage.retry import SDK_ATTEMPTS, STORAGE_RETRY

S3_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
GCS_EMULATOR_VAR = "STORAGE_EMULATOR_HOST"
TENSORSTORE_GCS_URL_VAR = "TENSORSTORE_GCS_HTTP_URL"
# Where the store is, passed on by name to a training or eval process. Credentials are not among
# them: they would show as resource config; a local process inherits them, a pod gets secret refs.
STORE_ENV_VARS = (*S3_ENDPOINT_VARS, GCS_EMULATOR_VAR, "AWS_REGION", "AWS_DEFAULT_REGION")
# Set in a pod whose Pipes messages travel through the store's bucket: its scheme, s3 or gs.
PIPES_BUCKET_ENV = "MARIN_PIPES_BUCKET"


class StoreUnavailableError(RuntimeError):
    """The store cannot be used at all: missing bucket, refused credentials, unreachable endpoint."""


def s3_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    e = os.environ if environ is None else environ
    return next((e[v] for v in S3_ENDPOINT_VARS if e.get(v)), None)


def store_process_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The store's location variables set here, for a training/eval process (a pod inherits nothing)."""
    e = os.environ if environ is None else environ
    env = {v: e[v] for v in STORE_ENV_VARS if e.get(v)}
    if e.get(GCS_EMULATOR_VAR) and not e.get(TENSORSTORE_GCS_URL_VAR):
        env[TENSORSTORE_GCS_URL_VAR] = e[GCS_EMULATOR_VAR]
    return env


def storage_options(prefix: str) -> dict[str, Any]:
    """fsspec options for the store: botocore retries 5xx, throttling and connection errors in its
    standard mode, ``SDK_ATTEMPTS`` tries per call, counted in the storage retry policy's total.
    gcsfs retries the same classes itself, with a fixed count it has no option for."""
    if prefix.startswith("s3://"):
        return {"config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": SDK_ATTEMPTS}}}
    return {}


def sdk_attempts(fs) -> int:
    """Tries the store's SDK makes per call by itself: botocore as configured by `storage_options`;
    gcsfs its fixed class-level count."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("s3", "s3a"):
        return SDK_ATTEMPTS
    if protocol in ("gs", "gcs"):
        return int(getattr(fs, "retries", 1))
    return 1


def tensorstore_retry_context(driver: str) -> dict[str, Any]:
    """Tensorstore's request retries for ``driver`` (``s3`` or ``gcs``): nothing wraps tensorstore,
    so it gets the policy's whole budget."""
    return {f"{driver}_request_retries": {"max_retries": STORAGE_RETRY.attempts - 1,
                                          "initial_delay": f"{STORAGE_RETRY.base_delay_s}s",
                                          "max_delay": f"{STORAGE_RETRY.max_delay_s}s"}}


def fix_kvstore(spec: dict[str, Any], url: str, endpoint: str | None) -> dict[str, Any]:
    """``spec`` as JAX built it for ``url``, with the retry policy, and a correct S3 kvstore for ``s3://``.

    For ``s3://`` JAX was given the ``gs://`` spelling of the same path (see the module docstring),
    so the kvstore (or an OCDBT store's base) is GCS-shaped: bucket and path are right, the
    driver is not.
    """
    kvstore = spec["kvstore"]
    base = kvstore["base"] if kvstore.get("driver") == "ocdbt" else kvstore
    if url.startswith("s3://"):
        base["driver"] = "s3"
        if endpoint:
            base["endpoint"] = endpoint
    if base.get("driver") in ("s3", "gcs"):
        base["context"] = tensorstore_retry_context(base["driver"])
    return spec


def _tensorstore_gcs_endpoint() -> None:
    """Tensorstore reads the GCS emulator's address under its own name."""
    if os.environ.get(GCS_EMULATOR_VAR):
        os.environ.setdefault(TENSORSTORE_GCS_URL_VAR, os.environ[GCS_EMULATOR_VAR])


def tensorstore_kvstore(url: str) -> dict[str, Any]:
    """The tensorstore kvstore for a store URL, as `install_tensorstore_paths` makes JAX build it
    (local: an absolute ``file`` path; ``gs://``/``s3://``: bucket and path, the endpoint and the
    retry policy), for code that writes Levanter's format without importing JAX."""
    _tensorstore_gcs_endpoint()
    for scheme, driver in (("gs://", "gcs"), ("s3://", "s3")):
        if url.startswith(scheme):
            bucket, _, path = url[len(scheme):].partition("/")
            if not bucket or not path.strip("/"):
                raise ValueError(f"{url}: a tensorstore path needs a bucket and a path inside it")
            kvstore = {"driver": driver, "bucket": bucket, "path": os.path.normpath(path)}
            return fix_kvstore({"kvstore": kvstore}, url, s3_endpoint())["kvstore"]
    if "://" in url and not url.startswith("file://"):
        raise ValueError(f"{url}: tensorstore paths are local, gs:// or s3://")
    return {"driver": "file", "path": os.path.abspath(url.removeprefix("file://"))}


_INSTALLED = False


def install_tensorstore_paths() -> None:
    """Route JAX's (and so Levanter's) tensorstore specs for ``s3://`` and ``gs://`` to the store's endpoint."""
    global _INSTALLED
    if _INSTALLED:
        return
    _tensorstore_gcs_endpoint()
    import jax.experimental.array_serialization.serialization as serialization

    original = serialization.get_tensorstore_spec

    def get_tensorstore_spec(ckpt_path, *args, **kwargs):
        url = str(ckpt_path)
        spec = original("gs://" + url[len("s3://"):] if url.startswith("s3://") else ckpt_path, *args, **kwargs)
        return fix_kvstore(spec, url, s3_endpoint())

    # Levanter's caches call `serialization.get_tensorstore_spec`, and JAX's own checkpoint
    # serializer looks the name up in that module, so this one attribute covers both.
    serialization.get_tensorstore_spec = get_tensorstore_spec
    _INSTALLED = True


def bucket_of(prefix: str) -> str | None:
    if "://" not in prefix or prefix.startswith("file://"):
        return None
    return prefix.split("://", 1)[1].split("/", 1)[0]


def check_store_reachable(fs, prefix: str) -> None:
    """Fail with one line naming ``prefix`` if its bucket is missing, refuses us, or cannot be reached.

    Without this, s3fs's ``makedirs`` would create a missing bucket on first write, and an
    unreachable endpoint would surface as a retry trace deep inside an asset.
    """
    bucket = bucket_of(prefix)
    if bucket is None:
        return
    endpoint = (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url") or getattr(fs, "_endpoint", None) \
        or (s3_endpoint() if prefix.startswith("s3://") else os.environ.get(GCS_EMULATOR_VAR))
    where = f" at {endpoint}" if endpoint else ""
    try:
        # gcsfs logs a full traceback for each exhausted retry; the error below says it in one line.
        with quiet_logger("gcsfs"):
            fs.ls(bucket, refresh=True)
    except FileNotFoundError as exc:
        raise StoreUnavailableError(f"store {prefix}: bucket {bucket} does not exist{where}; create it first") from exc
    except PermissionError as exc:
        raise StoreUnavailableError(f"store {prefix}: access to bucket {bucket}{where} refused; check the "
                                    f"credentials ({_first_line(exc)})") from exc
    except Exception as exc:  # noqa: BLE001 - every other failure here means the endpoint did not answer
        raise StoreUnavailableError(f"store {prefix}: cannot reach bucket {bucket}{where} "
                                    f"({type(exc).__name__}: {_first_line(exc)})") from exc


@contextlib.contextmanager
def quiet_logger(logger_name: str) -> Iterator[None]:
    """Drop the records of one logger (the root logger for "") below CRITICAL while inside."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
