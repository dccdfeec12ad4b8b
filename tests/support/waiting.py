"""The one way tests wait: poll a condition until it holds or a deadline passes (never a fixed sleep)."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05, details: Callable[[], str] | None = None) -> T:
    """The first truthy value of ``condition()``; fails naming ``what`` (and ``details()``) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}" + (f":\n{details()}" if details else ""))
        time.sleep(interval_s)
    return value


def answers_http(url: str, timeout_s: float = 5) -> bool:
    """Whether ``url`` answers a GET with a success status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for_http(url: str, server: subprocess.Popen, what: str, timeout_s: float = 180) -> None:
    """Wait until ``url`` answers; fails at once if ``server`` (the process serving it) exits."""

    def answered() -> bool:
        assert server.poll() is None, f"{what} exited"
        return answers_http(url)

    wait_for(answered, timeout_s, f"{what} to answer {url}", interval_s=0.5)
