"""CPU kernels compiled from Python by numba (no C compiler needed), where numba is installed."""

from __future__ import annotations

try:
    import numba
except ImportError:  # the kernels' callers keep their PyTorch paths
    numba = None


def available() -> bool:
    """Whether kernels can be compiled here (numba importable)."""
    return numba is not None


def compiled(fn):
    """``fn`` compiled on its first call (fast math, GIL released), the machine code cached on disk
    where numba finds a writable place (beside the module, or its user cache folder), else compiled
    again in each process."""
    if numba is None:
        return fn
    try:
        return numba.njit(fastmath=True, cache=True, nogil=True)(fn)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return numba.njit(fastmath=True, nogil=True)(fn)
