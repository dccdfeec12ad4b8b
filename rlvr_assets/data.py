"""Group ``data``: the GSM8k problems table and its quality checks."""

from typing import Optional

import pandas as pd
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)
from dagster_duckdb import DuckDBResource
from pydantic import Field

from resources import Settings, replace_tables
from rlvr import gsm8k
from rlvr_assets.plots import histogram_markdown

CHECKS = {
    "row_counts": "Rows per split match the source (7,473 train / 1,319 test for full GSM8k).",
    "answers_parse": "Every normalized final answer parses as a number.",
    "no_split_overlap": "No question (case- and whitespace-normalized hash) is in both splits.",
    "no_nulls": "No column is null or empty.",
}


class GSM8kSourceConfig(Config):
    """Which source fills ``gsm8k_problems``."""

    source: str = Field(default="local", description="'local' (official jsonl folder), 'hub' (openai/gsm8k), 'gsm_symbolic' or 'reasoning_gym' (offline generators)")
    local_dir: str = Field(default_factory=lambda: str(Settings.from_env().gsm8k_dir), description="folder with train.jsonl and test.jsonl (source 'local')")
    limit: Optional[int] = Field(default=None, description="keep only the first N problems of each split (local and hub)")
    task: str = Field(default="chain_sum", description="reasoning-gym task with numeric answers (source 'reasoning_gym')")
    task_config: dict = Field(default={}, description="keyword arguments of the reasoning-gym task (source 'reasoning_gym')")
    generated_train_size: int = Field(default=2000, description="problems generated for train (generated sources)")
    generated_test_size: int = Field(default=200, description="problems generated for test (generated sources)")
    seed: int = Field(default=0, description="generator seed (generated sources)")


def load_problems(config: GSM8kSourceConfig) -> tuple[list[gsm8k.Problem], dict[str, int]]:
    """Problems from the configured source, and the row count each split must have."""
    if config.source not in gsm8k.SOURCES:
        raise gsm8k.DataSourceError(f"unknown source {config.source!r}; expected one of {gsm8k.SOURCES}")
    if config.limit is not None and config.limit < 1:
        raise gsm8k.DataSourceError(f"limit must be at least 1, got {config.limit}")
    if config.source in ("gsm_symbolic", "reasoning_gym"):
        task = "gsm_symbolic" if config.source == "gsm_symbolic" else config.task
        problems = gsm8k.generate_reasoning_gym(
            task, config.generated_train_size, config.generated_test_size, config.seed, config.task_config or None
        )
        return problems, {"train": config.generated_train_size, "test": config.generated_test_size}
    if config.source == "local":
        problems = gsm8k.load_local(config.local_dir, limit=config.limit)
    else:
        problems = gsm8k.load_hub(limit=config.limit)
    expected = {s: min(n, config.limit or n) for s, n in gsm8k.OFFICIAL_COUNTS.items()}
    return problems, expected


@asset(
    group_name="data",
    kinds={"duckdb"},
    owners=["team:rlvr-data"],
    tags={"domain": "math"},
    check_specs=[AssetCheckSpec(name, asset="gsm8k_problems", description=text, blocking=True) for name, text in CHECKS.items()],
)
def gsm8k_problems(context: AssetExecutionContext, config: GSM8kSourceConfig, duckdb: DuckDBResource):
    """GSM8k problems, one row per problem: id, split, question, reference solution, normalized
    final answer (text and number), reasoning-step count, source and content hash.

    The table is validated before it is written and replaced in one transaction: a failed check or
    a bad source leaves the previous table untouched.
    """
    try:
        problems, expected = load_problems(config)
    except gsm8k.DataSourceError as err:
        raise Failure(description=f"gsm8k_problems: {err}") from None
    outcomes = gsm8k.validate_problems(problems, expected)
    results = [
        AssetCheckResult(
            check_name=o.name,
            passed=o.passed,
            severity=AssetCheckSeverity.ERROR,
            description=o.description,
            metadata=o.metadata,
        )
        for o in outcomes
    ]
    failed = [o for o in outcomes if not o.passed]
    if failed:
        for result in results:
            yield result
        raise Failure(
            description="gsm8k_problems failed its checks, the previous table was kept: "
            + "; ".join(f"{o.name}: {o.description}" for o in failed)
        )
    frame = pd.DataFrame([p.as_row() for p in problems])
    replace_tables(duckdb, {"gsm8k_problems": frame})
    counts = frame.groupby("split").size().to_dict()
    context.log.info(f"gsm8k_problems: {counts} from source {config.source!r}")
    yield MaterializeResult(
        metadata={
            "dagster/row_count": len(frame),
            "table": f"{duckdb.database}:gsm8k_problems",
            "source": config.source,
            **{f"{split}_rows": int(n) for split, n in counts.items()},
            "preview": MetadataValue.md(frame.head(5)[["problem_id", "split", "question", "answer_text", "num_steps"]].to_markdown(index=False)),
            "solution_length_words": MetadataValue.md(
                histogram_markdown(frame["solution"].str.split().str.len(), "Reference solution length (words)")
            ),
            "num_steps": MetadataValue.md(histogram_markdown(frame["num_steps"], "Reasoning steps per problem", discrete=True)),
        },
        check_results=results,
    )
