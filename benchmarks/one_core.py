"""Set-up for benchmarks that time one core; import it first (`python -m benchmarks.NAME`).

Drops this directory from `sys.path` (its scripts, e.g. tokenize.py, would shadow stdlib modules
of the same name) and sizes the numpy/BLAS/polars thread pools to one thread, which only works
before numpy or polars is imported.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "POLARS_MAX_THREADS"):
    os.environ[_variable] = "1"
