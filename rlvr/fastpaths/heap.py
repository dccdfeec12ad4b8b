"""Keep freed memory in the process heap, so that a training step does not page-fault its
temporaries in afresh every time.

glibc hands large freed blocks back to the kernel, and PyTorch's CPU allocator has no cache of its own,
so each GRPO update faults its hundreds of MiB of temporaries in again (and each engine step its logits and
sampling's). :func:`keep_freed_memory` makes
glibc serve everything from its heap and never trim it. ``bench/grpo_step.py`` prints the faults per
step both ways, ``bench/cpu_kernels.py`` times an update loop both ways (docs/architecture.md, "Fast paths").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_INT_MAX = 2**31 - 1


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse (no ``mmap`` per allocation, no trimming).

    Process-wide and lasting: memory the process has used stays mapped until it exits. Returns
    whether it took effect (False off glibc, e.g. macOS, Windows, musl).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
