"""Which source fills the problems table, as one config: :class:`ProblemSource` and :func:`load_problems`."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlvr.settings import Settings
from rlvr.tasks.gsm8k import dataset as gsm8k


@dataclass
class ProblemSource:
    """A source of GSM8k-style problems (``rlvr.tasks.gsm8k.dataset``) and its options."""

    source: str = "local"  # 'local' (official jsonl folder), 'hub' (openai/gsm8k), 'gsm_symbolic' or 'reasoning_gym' (offline generators)
    local_dir: str = field(default_factory=lambda: str(Settings.from_env().gsm8k_dir))  # folder with train.jsonl and test.jsonl (source 'local')
    limit: int | None = None  # keep only the first N problems of each split (local and hub)
    task: str = "chain_sum"  # reasoning-gym task with numeric answers (source 'reasoning_gym')
    task_config: dict = field(default_factory=dict)  # keyword arguments of the reasoning-gym task (source 'reasoning_gym')
    generated_train_size: int = 2000  # problems generated for train (generated sources)
    generated_test_size: int = 200  # problems generated for test (generated sources)
    seed: int = 0  # generator seed (generated sources)


def load_problems(config: ProblemSource) -> tuple[list[gsm8k.Problem], dict[str, int]]:
    """Problems from the configured source, and the row count each split must have.

    Raises ``gsm8k.DataSourceError`` for an unknown source, a bad limit or a failing source.
    """
    if config.source not in gsm8k.SOURCES:
        raise gsm8k.DataSourceError(f"unknown source {config.source!r}; expected one of {gsm8k.SOURCES}")
    if config.limit is not None and config.limit < 1:
        raise gsm8k.DataSourceError(f"limit must be at least 1, got {config.limit}")
    if config.source in ("gsm_symbolic", "reasoning_gym"):
        task = "gsm_symbolic" if config.source == "gsm_symbolic" else config.task
        problems = gsm8k.generate_reasoning_gym(task, config.generated_train_size, config.generated_test_size, config.seed, config.task_config or None)
        return problems, {"train": config.generated_train_size, "test": config.generated_test_size}
    if config.source == "local":
        problems = gsm8k.load_local(config.local_dir, limit=config.limit)
    else:
        problems = gsm8k.load_hub(limit=config.limit)
    expected = {s: min(n, config.limit or n) for s, n in gsm8k.OFFICIAL_COUNTS.items()}
    return problems, expected
