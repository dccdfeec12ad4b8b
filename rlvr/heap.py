"""Keep freed memory in the process heap, so that a training step does not page-fault its
temporaries in afresh every time.

glibc serves large allocations (128 KiB and up, rising to 32 MiB) with ``mmap`` and hands them back
to the kernel on ``free``; PyTorch's CPU allocator has no cache of its own. A GRPO update allocates
hundreds of MiB of such temporaries (the output layer's logits, the embedding gradient, attention
buffers), so every step touches fresh pages again: about 0.4-0.9 million minor page faults and
1-4 s of kernel time per update of the 135M model. :func:`keep_freed_memory` makes glibc serve
everything from its heap and never trim it: after the first steps the update reuses its own
pages. ``bench/cpu_kernels.py`` times an update both ways.
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
