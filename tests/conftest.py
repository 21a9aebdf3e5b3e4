"""Fixtures shared across test folders."""

import os
import uuid

import pytest

from marin_resources.environments import jax_cache_env


def _ops_fixtures():
    """tests/ops/conftest.py's moto_server / GCS emulator fixtures (started and stopped by PID), for the
    other folders (tests/ops uses its own conftest directly)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "ops" / "conftest.py"
    spec = importlib.util.spec_from_file_location("ops_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session", autouse=True)
def shared_jax_compilation_cache(tmp_path_factory):
    """One JAX compilation cache for every training process of the session, across xdist workers: a
    run that trains the same config again (a resume after kill -9, a rebuild, a test that repeats
    another's run) reads what was compiled, about half of such a run's CPU. Training processes get
    it through JAX_COMPILATION_CACHE_DIR, which the local launcher honours
    (tests/training/test_compilation_cache.py checks that a cached run trains bit for bit the same)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    for name, value in jax_cache_env(str(root / "jax_compilation_cache")).items():
        os.environ.setdefault(name, value)


_ops = _ops_fixtures()
s3_server, s3_prefix, gcs_server, gcs_prefix = _ops.s3_server, _ops.s3_prefix, _ops.gcs_server, _ops.gcs_prefix

# The machine's PostgreSQL (trust auth); CI runs on a machine that starts it before the session.
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "postgres"}


@pytest.fixture
def pg_database():
    """A throwaway database `marin_test_<random>`, dropped afterwards. A missing server fails the
    test with a clear message instead of skipping it: these tests are part of CI."""
    import psycopg2

    try:
        admin = psycopg2.connect(**PG, connect_timeout=5)
    except psycopg2.OperationalError as exc:
        pytest.fail(f"PostgreSQL is not reachable at {PG['host']}:{PG['port']} as user {PG['user']} "
                    f"(CI starts it; locally: service postgresql start): {exc}")
    admin.autocommit = True
    name = f"marin_test_{uuid.uuid4().hex[:12]}"
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture
def curation_planner(tmp_path, monkeypatch):
    """`make(sources_yaml_text) -> Planner` over the curation stage of that YAML, with its store under
    tmp_path and a fresh embedded instance (disposed afterwards); `plan.catalog` can be adjusted."""
    from pathlib import Path

    import dagster as dg

    from marin_assets.curation.assets import build_curation_stage
    from marin_assets.deployment import Deployment
    from marin_assets.planning import Planner
    from marin_assets.stages import build_stage
    from marin_resources.environments import MarinSettings, build_resources

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # the embedded default keeps its SQLite files there
    (home / "dagster.yaml").write_text((Path(__file__).resolve().parents[1] / "dagster.yaml").read_text())
    instances = []

    def make(sources_yaml: str) -> Planner:
        sources = tmp_path / "sources.yaml"
        sources.write_text(sources_yaml)
        settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SOURCES": str(sources)})
        stage, catalog = build_stage(build_curation_stage, settings, Deployment.load(settings))
        defs = dg.Definitions.merge(stage, dg.Definitions(resources=build_resources(settings)))
        instances.append(dg.DagsterInstance.from_config(str(home)))
        return Planner(defs, catalog, defs.resources["store"].get(), instances[-1])

    yield make
    for instance in instances:
        instance.dispose()


@pytest.fixture
def synthetic_deployment():
    """`make(runs={}, sweeps={}, mixture="m") -> Deployment` over one source `src`, tokenizer `t` and
    mixture `mixture` (both at version v1), for stages built without the bundled YAML files."""
    from marin_assets.curation.config import CurationConfig, SourceConfig
    from marin_assets.deployment import Deployment
    from marin_assets.tokenization.cache_config import CacheConfig
    from marin_assets.tokenization.registry import MixtureEntry, TokenizationRegistry, TokenizedEntry, TokenizerEntry
    from marin_assets.tokenization.tokenizer import TokenizerConfig

    def make(runs=None, sweeps=None, mixture: str = "m") -> Deployment:
        registry = TokenizationRegistry(
            tokenizers={"t": TokenizerEntry("t", TokenizerConfig(), train_on=("src",), version="v1")},
            tokenized={"src": TokenizedEntry("src", "t", CacheConfig())},
            mixtures={mixture: MixtureEntry(mixture, "t", {"src": 1.0})})
        curation = CurationConfig(sources=(SourceConfig(name="src", uri="/nonexistent/*.txt", format="text"),))
        return Deployment.resolve(curation, registry, runs or {}, sweeps or {})

    return make


def c_compiler() -> str | None:
    """The C compiler an install would build the curation kernels with, if this machine has one."""
    import shlex
    import shutil
    import sysconfig

    command = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(shlex.split(command)[0])


def pytest_runtest_setup(item):
    if item.get_closest_marker("compiled_kernels") and c_compiler() is None:
        pytest.skip("needs the compiled curation kernels, and this machine has no C compiler to build them "
                    "(their numpy twins run instead)")


def pytest_collection_modifyitems(config, items):
    """Whole files, longest first: files with a `heaviest` test, then files with a `slow` one, then
    the rest, each group in collection order. Under pytest-xdist (`--dist loadfile
    --no-loadscope-reorder`, see pyproject.toml; xdist would otherwise put the files with the most
    tests first) a worker takes the next file as it frees up, so the minutes-long files start at
    once instead of last; within a file the order is kept, so module fixtures are built once."""
    def rank(item) -> int:
        return 0 if item.get_closest_marker("heaviest") else 1 if item.get_closest_marker("slow") else 2

    file_rank: dict[str, int] = {}
    for item in items:
        file_rank[item.path] = min(file_rank.get(item.path, 2), rank(item))
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (file_rank[item.path], first_seen[item.path]))
