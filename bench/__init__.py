"""Benchmark scripts: run each from the repo root as ``python bench/<name>.py`` (or ``python -m bench.<name>``).

Shared plumbing (served processes, the Bento build, timing and percentiles, random-weight models) is
in ``bench.harness``; each script puts the repo root first on ``sys.path`` so ``bench`` and this tree's
``rlvr`` import either way.
"""
