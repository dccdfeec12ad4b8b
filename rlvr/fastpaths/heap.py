"""Keep freed memory in the process heap, so that a training step does not page-fault its
temporaries in afresh every time.

glibc serves large allocations (from 128 KiB; it raises that threshold up to 32 MiB as such
blocks are freed) with ``mmap`` and hands them back to the kernel on ``free``, and trims the top
of its heap; PyTorch's CPU allocator has no cache of its own. A GRPO update allocates hundreds of
MiB of temporaries (the output layer's logits, the embedding gradient, activations), so its pages
are faulted in again and again: for the 135M model 0.4-0.9 million minor faults (1.4-3.5 s of
kernel time) in each of the first steps and still 0.1 million (0.3-0.6 s) in later ones.
:func:`keep_freed_memory` makes glibc serve everything from its heap and never trim it: after
two steps an update faults in almost nothing. ``bench/grpo_step.py`` prints the faults per step
both ways, ``bench/cpu_kernels.py`` times an update loop both ways.
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
