"""keep_freed_memory: glibc keeps freed blocks for reuse instead of faulting fresh pages in again."""

import platform
import subprocess
import sys

import pytest

CHURN = """
import resource, sys
import numpy as np
from marin_resources.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):  # a batch's temporaries: allocated, filled, freed
    a = np.ones(3_000_000)
    b = a * 2
    del a, b
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_blocks_are_reused_not_faulted_in_again():
    faults = {mode: int(subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("default", "keep")}
    # 50 rounds of two 24 MB arrays: glibc's default maps them fresh each round (~585,000 faults);
    # kept on the heap, the pages are faulted in once.
    assert faults["keep"] * 10 < faults["default"], faults
