"""CPU kernels compiled from Python by numba (no C compiler needed), where numba is installed; and C++
ones built for this machine by PyTorch's extension builder (:func:`cpp_module`), where a compiler is."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Iterator

import torch

try:
    import numba
except ImportError:  # the kernels' callers keep their PyTorch paths
    numba = None

log = logging.getLogger(__name__)
_BUILDING = threading.Lock()  # one build at a time: each sets PATH for its own (_own_ninja_first)


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


@functools.cache
def cpp_module(what: str, prefix: str, source: str, functions: tuple[str, ...], flags: tuple[str, ...] = ()) -> Any:
    """``source``'s ``functions`` built with ``-O3 -march=native -fopenmp`` and ``flags`` under a name from
    ``prefix`` and a hash of the source, ``flags``, this CPU's and torch's version (so the build on disk is
    reused); None, logged naming ``what``, where no C++ compiler is or the build fails."""
    if shutil.which("c++") is None:
        log.info("%s off: no C++ compiler", what)
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
        name = prefix + hashlib.sha256((source + " ".join(flags) + cpu + torch.__version__).encode()).hexdigest()[:12]
        with _BUILDING, _own_ninja_first():
            return load_inline(name, cpp_sources=source, functions=list(functions), extra_cflags=["-O3", "-march=native", "-fopenmp", *flags])
    except Exception as err:  # noqa: BLE001 - any build failure leaves the callers' other path
        log.warning("%s off: the build failed (%s)", what, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None


@contextlib.contextmanager
def _own_ninja_first() -> Iterator[None]:
    """Within the block, this environment's ninja (the ``ninja`` package's) first on PATH, whatever PATH says
    (an activated virtual environment or not): ninja versions keep their build logs in different formats,
    and a ninja that finds another's log builds every kernel again (~25 s each here)."""
    try:
        import ninja
    except ImportError:  # a ninja from PATH, as PyTorch finds it
        yield
        return
    path = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
    try:
        yield
    finally:
        if path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = path
