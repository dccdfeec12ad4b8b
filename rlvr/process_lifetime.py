"""Processes that never outlive their parent: Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have Linux send ``sig`` to this process when its parent dies, so that it never outlives it.
    ``parent``: the pid its parent must have (default: the parent it has when called); if it has another
    one, the parent is gone already and ``sig`` is sent at once. ``sig`` takes its default action first
    where this process inherited it ignored or blocked (a launcher started in the background, whose
    SIGTERM Dagster maps to its ignored SIGINT), or the request would do nothing. A no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    if sig != signal.SIGKILL:
        let_signal_act(sig)
    expected = os.getppid() if parent is None else parent
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != expected:  # re-parented: the parent died before the request took effect
        os.kill(os.getpid(), sig)


def let_signal_act(sig: int) -> None:
    """Give ``sig`` its default action where this process inherited it ignored, and unblock it (both are
    inherited across fork and exec), so a signal meant to stop the process reaches it; a handler the
    process installed itself is kept."""
    if signal.getsignal(sig) == signal.SIG_IGN:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
