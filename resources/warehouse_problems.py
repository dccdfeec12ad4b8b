"""The warehouse's readers of every task's problems (``task_problems``): the rows a run trains and evaluates
on, the held-out hashes, and the drift reference questions."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import pandas as pd
from dagster import Failure

from resources.warehouse_snapshot import publish_snapshot
from resources.warehouse_tables import PROBLEM_VIEWS, PROBLEMS
from resources.warehouse_writes import Upsert
from rlvr.tasks import DEFAULT_TASK


class ProblemReads:
    """Part of :class:`resources.warehouse.Warehouse`: one task's problems in, any task's problems out."""

    def replace_task_problems(self, task: str, frame: pd.DataFrame) -> None:
        """Replace one task's rows of ``task_problems`` by ``frame`` in one transaction (other tasks' kept); a task
        whose problems once had a table of their own (:data:`PROBLEM_VIEWS`) gets that name back as a view of them."""
        self.write(Upsert(PROBLEMS, frame, "task"))
        if task in PROBLEM_VIEWS:
            with self.get_connection() as conn:
                conn.execute(PROBLEM_VIEWS[task][1])
                if self.publish_snapshot:
                    publish_snapshot(conn, Path(self.database))

    def task_problems(self, task: str, split: str, limit: int | None = None) -> list[dict]:
        """One task's rows of ``task_problems`` in ``split``, ordered by id (the first ``limit`` when given); the
        ``reference`` stays JSON text (``rlvr.tasks.problem_record`` spreads it). A Failure names what to materialize."""
        first = f"LIMIT {int(limit)}" if limit else ""
        frame = self._problem_rows(f"SELECT * FROM {PROBLEMS} WHERE task = ? AND split = ? ORDER BY problem_id {first}", [task, split])
        if frame is None or frame.empty:
            also = f"{PROBLEM_VIEWS[task][0]} or " if task in PROBLEM_VIEWS else ""
            raise Failure(description=f"task_problems has no rows of task {task!r} in split {split!r}: materialize {also}its partition {task!r} first")
        return frame.to_dict(orient="records")

    def problem_tasks(self) -> list[str]:
        """The tasks whose problems the warehouse holds."""
        frame = self._problem_rows(f"SELECT DISTINCT task FROM {PROBLEMS} ORDER BY task")
        return [] if frame is None else frame["task"].tolist()

    def held_out_question_hashes(self) -> set[str]:
        """The normalized-question hashes of every held-out (test) problem of every task: what training never sees."""
        frame = self._problem_rows(f"SELECT DISTINCT question_hash FROM {PROBLEMS} WHERE split = 'test'")
        return set() if frame is None else set(frame["question_hash"])

    def reference_questions(self, size: int, tasks: Mapping[str, float] | None = None) -> list[str]:
        """About ``size`` train questions: the drift reference of a policy trained on ``tasks`` (name -> weight;
        None: ``DEFAULT_TASK``), each task's share by its weight (:meth:`task_reference_questions`)."""
        tasks = tasks or {DEFAULT_TASK: 1.0}
        total = sum(tasks.values())
        return [q for task, weight in tasks.items() for q in self.task_reference_questions(task, max(1, round(size * weight / total)))]

    def task_reference_questions(self, task: str, size: int) -> list[str]:
        """Up to ``size`` of one task's train questions in a fixed pseudo-random order (by hash of the problem id);
        none while the warehouse holds no problems."""
        frame = self._problem_rows(f"SELECT question FROM {PROBLEMS} WHERE split = 'train' AND task = ? ORDER BY hash(problem_id) LIMIT ?", [task, size])
        return [] if frame is None else frame["question"].tolist()

    def _problem_rows(self, sql: str, params: list | None = None) -> pd.DataFrame | None:
        """``sql`` over ``task_problems``; None while it does not exist."""
        with self.get_connection() as conn:
            if not conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [PROBLEMS]).fetchone()[0]:
                return None
            return conn.execute(sql, params or []).df()
