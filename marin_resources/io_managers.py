"""UPath-based IO manager for small values: polars DataFrames as Parquet, JSON-able values as JSON.

Values land in the same layout as every other artifact,
`{prefix}/{asset key}/{version}-{fingerprint}/{partition}/value.{parquet,json}`, committed through the
store so they get a manifest (hashes, producer) and the same atomicity. A value has no identity
config, so its fingerprint is that of the empty config. Large artifacts never come
through here: they are written by their asset and passed on as `ArtifactHandle`s.
"""

from __future__ import annotations

import io
import json
from typing import Any

import dagster as dg
import polars as pl
from upath import UPath

from marin_resources.artifacts import VERSION_METADATA_KEY, MarinStore
from marin_resources.keys import marin_key
from marin_resources.storage.identity import fingerprint, validate_partition_key
from marin_resources.storage.store import producer_info, version_dir, writing

PARQUET_NAME = "value.parquet"
JSON_NAME = "value.json"
VALUE_FINGERPRINT = fingerprint({})


class ValueIOManager(dg.UPathIOManager):
    extension = ""

    def __init__(self, store: MarinStore):
        self._marin_store = store
        super().__init__(base_path=UPath(store.get().prefix, **store.storage_options))

    @staticmethod
    def _version(context: dg.InputContext | dg.OutputContext) -> str:
        output = context if isinstance(context, dg.OutputContext) else context.upstream_output
        metadata = (output.definition_metadata if output is not None else None) or {}
        return str(metadata.get(VERSION_METADATA_KEY, "v1"))

    def get_asset_relative_path(self, context: dg.InputContext | dg.OutputContext) -> UPath:
        return UPath(*marin_key(context.asset_key).split("/"), version_dir(self._version(context), VALUE_FINGERPRINT))

    def get_path_for_partition(self, context, path: UPath, partition: str) -> UPath:
        return path / validate_partition_key(partition)

    def dump_to_path(self, context: dg.OutputContext, obj: Any, path: UPath) -> None:
        store = self._marin_store.get()
        key = marin_key(context.asset_key)
        partition = context.asset_partition_key if context.has_asset_partitions else None
        with writing(store, key, self._version(context), partition, fingerprint=VALUE_FINGERPRINT,
                     run_id=context.run_id) as writer:
            if isinstance(obj, pl.DataFrame):
                buf = io.BytesIO()
                obj.write_parquet(buf)
                with writer.open(PARQUET_NAME) as fh:
                    fh.write(buf.getvalue())
                metrics = {"rows": obj.height, "columns": obj.width}
            else:
                with writer.open(JSON_NAME) as fh:
                    fh.write(json.dumps(obj, indent=2, sort_keys=True, default=str).encode())
                metrics = {"items": len(obj)} if isinstance(obj, (list, dict)) else {}
            writer.commit(config={}, upstream=[], producer=producer_info(context.run_id),
                          metrics=metrics)

    def load_from_path(self, context: dg.InputContext, path: UPath) -> Any:
        store = self._marin_store.get()
        if not (path / ".artifact.json").exists():
            raise dg.Failure(f"{path} has no committed value (no manifest)")
        if (path / PARQUET_NAME).exists():
            with store.fs.open(str(path / PARQUET_NAME), "rb") as fh:
                return pl.read_parquet(fh)
        return json.loads((path / JSON_NAME).read_text())


class ValueIOManagerFactory(dg.ConfigurableIOManagerFactory):
    store: MarinStore

    def create_io_manager(self, context) -> ValueIOManager:
        return ValueIOManager(self.store)
