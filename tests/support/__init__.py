"""The shared test harness: tiny models, a served Bento, Dagster run helpers, waiting on conditions.

Test modules import from here (``from support.tiny_models import tiny_llama``), never from each
other; tests/conftest.py puts tests/ on ``sys.path``, and subprocesses inherit it through PYTHONPATH.
"""
