"""Process hygiene for the training and eval entry points."""

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the launching process dies.

    If the Dagster step that launched training is killed, an orphaned trainer would keep writing
    into the artifact directory while a re-run resumes there; two writers would corrupt it.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
