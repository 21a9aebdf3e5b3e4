"""A training host without Dagster (docs/tpu-host.md): the processes it runs import none, and the
wheelhouse that deploy/tpu_host/ builds for it holds the locked versions."""

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]

TRAINING_PATH = (
    "benchmarks.gpu_train",
    "marin_assets.training.train_main",
    "marin_assets.training.eval_main",
    "marin_assets.training.export_main",
    "marin_assets.training.commands",
)


def test_the_training_path_imports_no_dagster():
    """Only dagster_pipes, the one package the processes report through; Dagster itself (and its
    integrations) is not installed on such a host. Run as the benchmark runs: a fresh process."""
    probe = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import " + ", ".join(TRAINING_PATH) + "; "
             "print(' '.join(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0].startswith('dagster')})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["dagster_pipes"]


def requirement_pins(name: str) -> dict[str, str]:
    lines = (REPO / "deploy" / "tpu_host" / name).read_text().splitlines()
    pins = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    return {canonicalize_name(pin.split("==")[0]): pin.split("==")[1] for pin in pins}


def test_the_wheelhouse_holds_the_locked_versions():
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    locked = {canonicalize_name(package["name"]): package["version"] for package in lock["package"]}
    pins = requirement_pins("requirements-wheelhouse.txt")
    assert {name: version for name, version in pins.items() if locked.get(name) != version} == {}


def test_the_lists_leave_the_hosts_jax_alone_and_name_each_package_once():
    spec = importlib.util.spec_from_file_location("check_install", REPO / "deploy" / "tpu_host" / "check_install.py")
    check_install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_install)
    wheelhouse = requirement_pins("requirements-wheelhouse.txt")
    host_index = requirement_pins("requirements-host-index.txt")
    assert set(wheelhouse) & set(host_index) == set()
    assert (set(wheelhouse) | set(host_index)) & check_install.HOST_OWNED == set()
