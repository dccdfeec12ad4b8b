"""Group ``data``: GSM8k's problems, the pipeline's task, with the quality checks of its source."""

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
from rlvr.plots import histogram_markdown
from rlvr.tasks import GSM8K
from rlvr.tasks.gsm8k import dataset as gsm8k
from rlvr.tasks.gsm8k import gsm8k_task_problem
from rlvr.tasks.gsm8k.source import ProblemSource, load_problems
from rlvr_assets.checks import blocking_checks
from rlvr_assets.metering import metered

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
@metered
def gsm8k_problems(context: AssetExecutionContext, config: GSM8kSourceConfig, duckdb: Warehouse):
    """GSM8k's problems in ``task_problems``, as every task's (task ``gsm8k``: id, split, question, the ``reference``
    its rewards grade against as JSON: solution and normalized final answer; reasoning steps, source, hashes),
    and the view ``gsm8k_problems`` of them with those columns spread (SQL written for the older table still runs).

    Checked against the source before it is written, in one transaction: a failed check or a bad source leaves
    the previous rows untouched. The pipeline's handle on the ``task_problems`` partition ``gsm8k``.
    """
    try:
        problems, expected = load_problems(config.to_core())
    except gsm8k.DataSourceError as err:
        raise Failure(description=f"gsm8k_problems: {err}") from None
    results = yield from blocking_checks(gsm8k.validate_problems(problems, expected), "gsm8k_problems")
    frame = pd.DataFrame([gsm8k_task_problem(p).as_row() for p in problems])
    duckdb.replace_task_problems(GSM8K.name, frame)
    counts = frame.groupby("split").size().to_dict()
    context.log.info(f"gsm8k_problems: {counts} from source {config.source!r}")
    yield MaterializeResult(
        metadata={
            "dagster/row_count": len(frame),
            "table": f"{duckdb.database}:task_problems",
            "view": f"{duckdb.database}:gsm8k_problems",
            "source": config.source,
            **{f"{split}_rows": int(n) for split, n in counts.items()},
            "preview": MetadataValue.md(
                pd.DataFrame([p.as_row() for p in problems[:5]])[["problem_id", "split", "question", "answer_text", "num_steps"]].to_markdown(index=False)
            ),
            "solution_length_words": MetadataValue.md(
                histogram_markdown(pd.Series([len(p.solution.split()) for p in problems]), "Reference solution length (words)")
            ),
            "num_steps": MetadataValue.md(histogram_markdown(frame["num_steps"], "Reasoning steps per problem", discrete=True)),
        },
        check_results=results,
    )
