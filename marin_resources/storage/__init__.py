"""The artifact store, with no Dagster in it: what an artifact is and where it lives (`store`), its
identity and fingerprints (`identity`), whether it is fresh (`freshness`), who may write it
(`leases`), where its bytes came from (`lineage`, `signing`), and the object stores under it
(`object_stores`, `retry`, `secrets`), kept tidy by `gc` and `migrate`. The `marin` CLI, the tests
and any other tool read a store through this package alone; the Dagster adapters (IO managers,
resources, launchers) sit beside it in `marin_resources`, and an import-linter contract
(`pyproject.toml`) keeps Dagster out."""
