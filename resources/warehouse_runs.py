"""The warehouse's readers of training runs and evaluations: a run's rollout and reward summary, an
evaluation's per-problem rows."""

from __future__ import annotations

import pandas as pd

from rlvr.tasks import DEFAULT_TASK


class RunReads:
    """Part of :class:`resources.warehouse.Warehouse`: what training runs and evaluations stored."""

    def eval_results(self, eval_id: str) -> pd.DataFrame | None:
        """The stored per-problem rows of one evaluation (ordered by problem), or None."""
        if not self.table_exists("eval_results"):
            return None
        frame = self.query("SELECT * FROM eval_results WHERE eval_id = ? ORDER BY problem_id", [eval_id])
        return frame if len(frame) else None

    def latest_evaluation(self, policy_version: str | None, task: str | None = None) -> pd.DataFrame | None:
        """Per-problem rows of the most recent evaluation of ``policy_version`` (with ``completion_chars``), of
        ``task`` only when given (rows stored before evaluations named their task are GSM8k's), or None."""
        if policy_version is None or not self.table_exists("eval_results"):
            return None
        columns = self.query("SELECT column_name FROM information_schema.columns WHERE table_name = 'eval_results'")["column_name"]
        of_task = "" if task is None else f"AND {'coalesce(task, ?)' if 'task' in set(columns) else '?'} = ?"
        params = [policy_version] + ([] if task is None else [DEFAULT_TASK, task])
        frame = self.query(
            "SELECT *, length(completion) AS completion_chars, well_formed::DOUBLE AS well_formed FROM eval_results "
            f"WHERE policy_version = ? {of_task} AND eval_id = "
            f"(SELECT eval_id FROM eval_results WHERE policy_version = ? {of_task} ORDER BY evaluated_at DESC LIMIT 1)",
            params + params,
        )
        return frame if len(frame) else None

    def training_run_summary(self, run_id: str) -> dict:
        """Finish reasons of a training run's rollouts, its mean value per reward and its reward rows, and
        its tool use: completions that called a tool, calls, calls that failed."""
        runs = [run_id]
        finish = self.query_partitions("rollouts", runs, "SELECT finish_reason, count(*) AS n FROM {rows} WHERE run_id = ? GROUP BY 1", runs)
        rewards = self.query_partitions("rewards", runs, "SELECT reward_name, avg(value) AS mean, count(*) AS n FROM {rows} WHERE run_id = ? GROUP BY 1", runs)
        tools = {"completions_calling": 0, "tool_calls": 0, "tool_errors": 0}
        if self.table_exists("tool_calls"):
            used = self.query_partitions(
                "tool_calls",
                runs,
                "SELECT count(DISTINCT completion_id) AS completions_calling, count(*) AS tool_calls, count(error) AS tool_errors FROM {rows} WHERE run_id = ?",
                runs,
            )
            tools = {k: int(used[k].iloc[0]) for k in tools}
        return {
            "finish_reasons": {r: int(n) for r, n in zip(finish["finish_reason"], finish["n"])},
            "reward_means": {r: float(m) for r, m in zip(rewards["reward_name"], rewards["mean"])},
            "reward_rows": int(rewards["n"].sum()),
            **tools,
        }
