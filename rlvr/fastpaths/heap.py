"""Keep freed memory in the process heap, so that a training step does not page-fault its
temporaries in afresh every time; and back tensors streamed every step with 2 MiB pages (:func:`huge_pages`).

glibc hands large freed blocks back to the kernel, and PyTorch's CPU allocator has no cache of its own,
so each GRPO update faults its hundreds of MiB of temporaries in again (and each engine step its logits and
sampling's). :func:`keep_freed_memory` makes
glibc serve everything from its heap and never trim it. ``bench/grpo_step.py`` prints the faults per
step both ways, ``bench/cpu_kernels.py`` times an update loop both ways (docs/architecture.md, "Fast paths").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_INT_MAX = 2**31 - 1
_MADV_HUGEPAGE, _HUGE_PAGE = 14, 2 << 20  # Linux's madvise advice (mman.h) and its transparent huge page size


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse (no ``mmap`` per allocation, no trimming).

    Process-wide and lasting: memory the process has used stays mapped until it exits. Returns
    whether it took effect (False off glibc, e.g. macOS, Windows, musl).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    return bool(_libc().mallopt(_M_MMAP_MAX, 0)) and bool(_libc().mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


def huge_pages(tensor: "torch.Tensor") -> "torch.Tensor":
    """``tensor`` (a CPU tensor not yet written), its memory's whole 2 MiB extents advised to Linux as
    huge-page backed (``MADV_HUGEPAGE``; transparent huge pages in ``madvise`` mode, the common default, use
    them only where asked): a tensor read through every step (packed weights, KV slots) then takes a 512th
    of the TLB misses. Pages already written keep their size. Best effort: a no-op off Linux."""
    if tensor.device.type != "cpu" or platform.system() != "Linux":
        return tensor
    start = tensor.data_ptr()
    begin, end = -(-start // _HUGE_PAGE) * _HUGE_PAGE, (start + tensor.untyped_storage().nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    if end > begin:
        _libc().madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), _MADV_HUGEPAGE)
    return tensor


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
