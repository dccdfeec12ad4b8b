"""Group ``data``: the GSM8k problems table and its quality checks."""

import pandas as pd
from dagster import (
    AssetCheckSpec,
    AssetExecutionContext,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from resources import WRITER_POOL, Warehouse, config_from
from rlvr import gsm8k
from rlvr.plots import histogram_markdown
from rlvr.problem_source import ProblemSource, load_problems
from rlvr.tasks import GSM8K
from rlvr.tasks.gsm8k_task import gsm8k_task_problem
from rlvr_assets.checks import blocking_checks

CHECKS = {
    "row_counts": "Rows per split match the source (7,473 train / 1,319 test for full GSM8k).",
    "answers_parse": "Every normalized final answer parses as a number.",
    "no_split_overlap": "No question (case- and whitespace-normalized hash) is in both splits.",
    "no_nulls": "No column is null or empty.",
}


class GSM8kSourceConfig(config_from(ProblemSource)):
    """Which source fills ``gsm8k_problems``."""


@asset(
    group_name="data",
    kinds={"duckdb"},
    owners=["team:rlvr-data"],
    tags={"domain": "math"},
    pool=WRITER_POOL,
    check_specs=[AssetCheckSpec(name, asset="gsm8k_problems", description=text, blocking=True) for name, text in CHECKS.items()],
)
def gsm8k_problems(context: AssetExecutionContext, config: GSM8kSourceConfig, duckdb: Warehouse):
    """GSM8k problems, one row per problem: id, split, question, reference solution, normalized
    final answer (text and number), reasoning-step count, source and content hash; as every task's
    problems, also its ``task`` (``gsm8k``) and the ``reference`` its rewards grade against (JSON).

    The table is validated before it is written and replaced in one transaction: a failed check or
    a bad source leaves the previous table untouched.
    """
    try:
        problems, expected = load_problems(config.to_core())
    except gsm8k.DataSourceError as err:
        raise Failure(description=f"gsm8k_problems: {err}") from None
    results = yield from blocking_checks(gsm8k.validate_problems(problems, expected), "gsm8k_problems")
    frame = pd.DataFrame([{**p.as_row(), "task": GSM8K.name, "reference": gsm8k_task_problem(p).as_row()["reference"]} for p in problems])
    duckdb.replace_tables({"gsm8k_problems": frame})
    counts = frame.groupby("split").size().to_dict()
    context.log.info(f"gsm8k_problems: {counts} from source {config.source!r}")
    yield MaterializeResult(
        metadata={
            "dagster/row_count": len(frame),
            "table": f"{duckdb.database}:gsm8k_problems",
            "source": config.source,
            **{f"{split}_rows": int(n) for split, n in counts.items()},
            "preview": MetadataValue.md(frame.head(5)[["problem_id", "split", "question", "answer_text", "num_steps"]].to_markdown(index=False)),
            "solution_length_words": MetadataValue.md(histogram_markdown(frame["solution"].str.split().str.len(), "Reference solution length (words)")),
            "num_steps": MetadataValue.md(histogram_markdown(frame["num_steps"], "Reasoning steps per problem", discrete=True)),
        },
        check_results=results,
    )
