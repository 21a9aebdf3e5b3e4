"""The suite passes on a clone in any folder (issue 52, item 3): no test, fixture or benchmark reads a
path beside the repository (the Chinchilla points once came from ../shared/data), and the tests that
read reference data pass from a copy of the repository with nothing around it.

The static scan follows every path built from a file's own location (``Path(__file__)`` with
``.parent``, ``.parents[k]``, ``/ "part"``; ``os.path.dirname``/``join`` on ``__file__``; names
assigned from those) and every path literal relative to the working directory (``Path("..")``,
``open("../x")``; pytest and the benchmarks run from the repository root). Absolute system paths
(``/usr/share/doc``, ``/tmp``) are the machine's, not the clone's surroundings, and are not judged.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "benchmarks")
PATH_CALLS = {"Path", "pathlib.Path", "open", "os.path.abspath", "os.path.realpath", "os.path.normpath"}


def dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def literal(node: ast.AST):
    return node.value if isinstance(node, ast.Constant) else None


class PathsFromLocation:
    """Lexically resolves the path expressions of one file, at its place in the repository."""

    def __init__(self, file: Path):
        self.file = file
        self.names: dict[str, Path] = {}

    def resolve(self, node: ast.AST) -> Path | None:
        if isinstance(node, ast.Name):
            return self.file if node.id == "__file__" else self.names.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            base = self.resolve(node.value)
            return base.parent if base is not None else None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
            base, k = self.resolve(node.value.value), literal(node.slice)
            if base is None or not isinstance(k, int):
                return None
            return Path(os.path.normpath(base.joinpath(*[".."] * (k + 1))))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            base, part = self.resolve(node.left), literal(node.right)
            return Path(os.path.normpath(base / part)) if base is not None and isinstance(part, str) else None
        if isinstance(node, ast.Call):
            return self._call(node)
        return None

    def _call(self, node: ast.Call) -> Path | None:
        name = dotted(node.func)
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("resolve", "absolute") and not node.args:
            return self.resolve(node.func.value)
        if not node.args:
            return None
        first = node.args[0]
        if name in PATH_CALLS:
            text = literal(first)
            if isinstance(text, str) and not os.path.isabs(text):
                return Path(os.path.normpath(REPO / text))  # relative to the working directory, the repository
            return self.resolve(first)
        if name == "os.path.dirname":
            base = self.resolve(first)
            return base.parent if base is not None else None
        if name == "os.path.join":
            base, parts = self.resolve(first), [literal(a) for a in node.args[1:]]
            if base is not None and all(isinstance(p, str) for p in parts):
                return Path(os.path.normpath(base.joinpath(*parts)))
        return None

    def escaping(self, source: str) -> list[str]:
        """``line N: path`` for each path expression that resolves outside the repository."""
        found = {}
        tree = ast.parse(source)
        for node in ast.walk(tree):  # names first, so that uses anywhere in the file resolve
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                if (value := self.resolve(node.value)) is not None:
                    self.names[node.targets[0].id] = value
        for node in ast.walk(tree):
            path = self.resolve(node) if isinstance(node, ast.expr) else None
            if path is not None and not path.is_relative_to(REPO):
                found.setdefault(node.lineno, f"line {node.lineno}: {path}")
        return [found[line] for line in sorted(found)]


def scanned_files() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (REPO / folder).rglob("*.py"))


def test_no_test_or_benchmark_reads_beside_the_repository():
    escapes = {str(p.relative_to(REPO)): PathsFromLocation(p).escaping(p.read_text()) for p in scanned_files()}
    assert {file: lines for file, lines in escapes.items() if lines} == {}
    assert len(escapes) > 100  # the scan saw the suite, not an empty folder


@pytest.mark.parametrize("source, line", [
    # tests/scaling/conftest.py before issue 52 and benchmarks/fit.py's default.
    ('SHARED = Path(__file__).resolve().parents[2].parent / "shared"', 1),
    ('REPO = Path(__file__).resolve().parents[2]\nDATA = REPO.parent / "shared" / "data" / "points.csv"', 2),
    ('ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))\nX = os.path.join(ROOT, "..", "..", "x")', 2),
    ('def load():\n    return open("../shared/data/points.csv")', 2),
    ('HERE = Path(__file__).parent\nDATA = HERE / ".." / ".." / ".." / "elsewhere"', 2),
])
def test_the_scan_catches_a_path_beside_the_repository(source, line):
    conftest = REPO / "tests" / "scaling" / "conftest.py"
    (escape,) = PathsFromLocation(conftest).escaping(source)
    assert escape.startswith(f"line {line}: ") and not Path(escape.split(": ", 1)[1]).is_relative_to(REPO)


def test_paths_inside_the_repository_and_system_paths_pass():
    source = ('REPO = Path(__file__).resolve().parents[2]\nDATA = REPO / "scaling" / "data"\n'
              'PAGES = Path("/usr/share/doc")\nBAD = "../../etc"  # a refused partition name, not a path\n')
    assert PathsFromLocation(REPO / "tests" / "scaling" / "conftest.py").escaping(source) == []


@pytest.mark.slow  # copies the repository and runs a test file and a benchmark there
def test_reference_data_tests_pass_from_a_copy_in_another_folder(tmp_path):
    """A clone somewhere else, with no ``shared`` folder beside it: the tests that read the Chinchilla
    points, and the benchmark that fits them, import and read everything from the copy."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    clone = tmp_path / "somewhere" / "marin-dagster"
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            (clone / name).write_bytes(source.read_bytes())
    assert not (clone.parent / "shared").exists()
    # The copy's packages, not the editable install's (which points at this checkout).
    env = {**os.environ, "PYTHONPATH": str(clone)}
    tests = subprocess.run([sys.executable, "-m", "pytest", "tests/scaling/test_scaling_chinchilla.py", "-n", "0",
                            "-p", "no:cacheprovider", "-q"], cwd=clone, env=env, capture_output=True, text=True,
                           timeout=900)
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:] + tests.stderr[-3000:]
    where = subprocess.run([sys.executable, "-c", "import scaling; print(scaling.__file__)"], cwd=clone, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(clone)
    bench = subprocess.run([sys.executable, "benchmarks/fit.py", "--scipy-starts", "9"], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=900)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    assert f"data: {clone / 'scaling' / 'data' / 'chinchilla_points.csv'} (240 points)" in bench.stdout
