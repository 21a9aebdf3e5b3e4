"""Check a TPU host's install for the training, evaluation and export processes (docs/tpu-host.md).

    PYTHONPATH=$PYTHONPATH:SITE python3 deploy/tpu_host/check_install.py SITE

Three checks, one line per problem and exit code 1 if any: SITE holds none of the host's own JAX
packages and ``jax`` imports from elsewhere; every requirement of each distribution in SITE (with
the extras asked for) is met by what the path holds; everything the processes import, at the top of
a module or inside a function (found in the project's source), imports, and so does the benchmark.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
HOST_OWNED = {"jax", "jaxlib", "libtpu", "numpy", "scipy", "ml-dtypes", "opt-einsum"}
# Required by levanter but left out (requirements-host-index.txt): gcsfs serves gs:// paths only and
# the host's index lacks it; ray[default] adds a Ray cluster's dashboard and agents, and the training
# process starts no cluster (levanter_config: ray.auto_start_cluster false).
LEFT_OUT = {"gcsfs", "ray[default]"}
PROCESSES = ("marin_assets.training.train_main", "marin_assets.training.eval_main", "marin_assets.training.export_main")
PROJECT = ("marin_assets", "marin_resources", "scaling")
# Imported only when the processes report through a bucket (a pod's MARIN_PIPES_BUCKET: reporting.py).
BUCKET_ONLY = ("boto3", "google.cloud")


def requirement_problems(req: Requirement, needed_by: str) -> list[str]:
    if canonicalize_name(req.name) in LEFT_OUT:
        return []
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        return [f"{needed_by} needs {req}: not installed"]
    if not req.specifier.contains(version, prereleases=True):
        return [f"{needed_by} needs {req}: {req.name} {version} is installed"]
    problems = []
    for extra in sorted(req.extras):
        if f"{canonicalize_name(req.name)}[{extra}]" in LEFT_OUT:
            continue
        for line in md.requires(req.name) or []:
            sub = Requirement(line)
            if sub.marker and sub.marker.evaluate({"extra": extra}) and not sub.marker.evaluate({"extra": ""}):
                problems += requirement_problems(sub, f"{req.name}[{extra}]")
    return problems


def install_problems(site: Path) -> list[str]:
    dists = list(md.distributions(path=[str(site)]))
    if not dists:
        return [f"{site} holds no distributions: run deploy/tpu_host/install.sh"]
    problems = [f"{site} holds {d.metadata['Name']}, which the host provides" for d in dists
                if canonicalize_name(d.metadata["Name"]) in HOST_OWNED]
    for dist in dists:
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                problems += requirement_problems(req, f"{dist.metadata['Name']} {dist.version}")
    return problems


def project_source(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def imports_of_processes() -> list[tuple[str, str | None]]:
    """(module, name) for each ``import module`` (name None) and ``from module import name`` in the
    processes' modules and the project modules they reach, functions' bodies included."""
    found: list[tuple[str, str | None]] = []
    seen: set[str] = set()
    stack = list(PROCESSES)
    while stack:
        module = stack.pop()
        source = project_source(module) if module.split(".")[0] in PROJECT else None
        if module in seen or source is None:
            continue
        seen.add(module)
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                pairs = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for name, attr in pairs:
                if name.startswith(BUCKET_ONLY) or name == "__future__":
                    continue
                found.append((name, attr))
                parts = name.split(".")
                stack += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
                stack += [f"{name}.{attr}"] if attr else []
    return list(dict.fromkeys(found))


def import_problems(site: Path) -> list[str]:
    sys.path.insert(0, str(REPO))
    problems = []
    import jax

    if Path(jax.__file__).resolve().is_relative_to(site.resolve()):
        problems.append(f"jax imports from {site}, not the host's")
    failures: dict[str, str] = {}  # one line per distinct error, with the first statement that met it
    for module, attr in [*imports_of_processes(), ("benchmarks.gpu_train", None)]:
        try:
            imported = importlib.import_module(module)
            if attr and not hasattr(imported, attr):
                importlib.import_module(f"{module}.{attr}")
        except Exception as exc:  # noqa: BLE001 - any failure to import is the finding
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            failures.setdefault(error, f"from {module} import {attr}" if attr else f"import {module}")
    return problems + [f"{statement}: {error}" for error, statement in failures.items()]


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    site = Path(sys.argv[1])
    problems = install_problems(site)
    problems += import_problems(site) if not problems else []
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    import jax

    count = len(list(md.distributions(path=[str(site)])))
    print(f"ok: {count} distributions in {site}; jax {jax.__version__} from {Path(jax.__file__).parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
