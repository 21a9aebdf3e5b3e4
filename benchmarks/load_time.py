"""How long the code location takes to load, and proof that it imports no heavy ML stack.

Runs `import marin_assets.definitions` in fresh interpreters (as `dagster dev` and the gRPC
server do) and prints the wall time beside a baseline: importing dagster alone. It loads twice:
with a local store, and with an unreachable one (`s3://` on a closed port), which a load that
read the store would wait on. Budget: 5 s, and none of jax, levanter, haliax, ray in sys.modules.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

PROBE = """
import sys, time
t = time.perf_counter()
{stmt}
elapsed = time.perf_counter() - t
heavy = sorted(m for m in ("jax", "levanter", "haliax", "ray", "torch") if m in sys.modules)
print(elapsed, ",".join(heavy))
"""


# Port 9 (discard) has no listener here: a connection is refused, or a firewall lets it hang.
UNREACHABLE = {"MARIN_PREFIX": "s3://marin-unreachable/store", "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
               "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_EC2_METADATA_DISABLED": "true"}


def measure(stmt: str, repeats: int, env: dict[str, str] | None = None) -> tuple[list[float], str]:
    times, heavy = [], ""
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", PROBE.format(stmt=stmt)], capture_output=True, text=True,
                             check=True, env={**os.environ, **(env or {})})
        seconds, heavy = out.stdout.strip().split(" ") if " " in out.stdout.strip() else (out.stdout.strip(), "")
        times.append(float(seconds))
    return times, heavy


def main() -> int:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    load = "import marin_assets.definitions as d; d.defs.resolve_asset_graph()"
    with tempfile.TemporaryDirectory() as store:
        ours, heavy = measure(load, repeats, {"MARIN_PREFIX": store})
    unreachable, _ = measure(load, repeats, UNREACHABLE)
    base, _ = measure("import dagster", repeats)
    print(f"{'what':<44}{'median s':>10}{'max s':>10}")
    print(f"{'import dagster (baseline)':<44}{statistics.median(base):>10.2f}{max(base):>10.2f}")
    print(f"{'load marin code location, local store':<44}{statistics.median(ours):>10.2f}{max(ours):>10.2f}")
    print(f"{'load marin code location, unreachable s3://':<44}{statistics.median(unreachable):>10.2f}"
          f"{max(unreachable):>10.2f}")
    print(f"heavy modules imported: {heavy or 'none'}; budget 5.0 s")
    print(json.dumps({"load_s_median": round(statistics.median(ours), 3), "load_s_max": round(max(ours), 3),
                      "unreachable_store_load_s_median": round(statistics.median(unreachable), 3),
                      "unreachable_store_load_s_max": round(max(unreachable), 3),
                      "dagster_import_s": round(statistics.median(base), 3),
                      "heavy_imports": heavy.split(",") if heavy else []}))
    return 0 if max(ours + unreachable) <= 5.0 and not heavy else 1


if __name__ == "__main__":
    sys.exit(main())
