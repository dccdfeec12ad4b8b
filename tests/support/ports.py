"""Local ports for servers a test starts: the benchmarks' ``free_port``, one copy for both."""

from __future__ import annotations

from bench.harness import free_port

__all__ = ["free_port"]
