"""Tasks in Dagster on real stores: a task's problems as its partition, a GRPO run on a mixture of two
tasks with per-task curves in MLflow and task-tagged rows, each task's evaluation of a policy (task x
policy partition), and the cross-task report; bad task input refused before any work."""

import duckdb
import pandas as pd
import pytest
from dagster import DagsterInstance, MultiPartitionKey, materialize

from resources import Upsert
from rlvr.policy import policy_tasks
from rlvr.tasks import Task, TaskProblem, register_task
from rlvr_assets import data, models, tasks, training
from rlvr_assets.partitions import policy_key
from support.pipeline import PROTOCOL, resources_for, run_config

pytestmark = pytest.mark.slow  # materializes Dagster assets and trains

ARITHMETIC = "reasoning_gym:basic_arithmetic"
SMALL = {"options": {"train_size": 12, "test_size": 4}}


def problems_of(instance, res, task, config=SMALL):
    return materialize(
        [tasks.task_problems],
        resources=res,
        run_config={"ops": {"task_problems": {"config": config}}},
        instance=instance,
        partition_key=task,
        raise_on_error=False,
    )


def rows(home, sql):
    with duckdb.connect(str(home / "rlvr.duckdb"), read_only=True) as conn:
        return conn.execute(sql).fetchall()


def test_each_task_is_its_own_partition_and_bad_options_keep_the_rows(home):
    res = resources_for(home)
    with DagsterInstance.ephemeral() as instance:
        assert problems_of(instance, res, ARITHMETIC).success
        assert problems_of(instance, res, "reasoning_gym:spell_backward", {"options": {"train_size": 6, "test_size": 3}}).success
        counts = dict(((task, split), n) for task, split, n in rows(home, "SELECT task, split, count(*) FROM task_problems GROUP BY 1, 2"))
        assert counts == {
            (ARITHMETIC, "train"): 12,
            (ARITHMETIC, "test"): 4,
            ("reasoning_gym:spell_backward", "train"): 6,
            ("reasoning_gym:spell_backward", "test"): 3,
        }

        bad = problems_of(instance, res, ARITHMETIC, {"options": {"train_sise": 3}})
        assert not bad.success
        assert "train_sise" in str(bad.failure_data_for_node("task_problems").error.message)
        assert rows(home, f"SELECT count(*) FROM task_problems WHERE task = '{ARITHMETIC}'") == [(16,)]  # the previous rows kept


def test_a_mixture_trains_with_per_task_curves_and_every_task_is_evaluated_and_compared(home, gsm8k_dir, tiny_llama_dir):
    res = resources_for(home)
    config = run_config(gsm8k_dir, tiny_llama_dir, steps=2)
    config["ops"]["grpo_training"]["config"]["tasks"] = {"gsm8k": 1.0, ARITHMETIC: 1.0}
    config["ops"]["grpo_training"]["config"]["overrides"]["prompts_per_step"] = 4
    with DagsterInstance.ephemeral() as instance:
        ops = {k: v for k, v in config["ops"].items() if k in ("gsm8k_problems", "base_policy")}
        assert materialize([data.gsm8k_problems, models.base_policy], resources=res, run_config={"ops": ops}, instance=instance).success
        assert problems_of(instance, res, ARITHMETIC).success

        trained = materialize(
            [data.gsm8k_problems, models.base_policy, training.grpo_training],
            resources=res,
            run_config={"ops": {"grpo_training": config["ops"]["grpo_training"]}},
            instance=instance,
            selection=[training.grpo_training],
        )
        assert trained.success
        by_task = dict(rows(home, "SELECT task, count(*) FROM rollouts GROUP BY 1"))
        assert set(by_task) == {"gsm8k", ARITHMETIC} and sum(by_task.values()) == 2 * 4 * 2  # steps x prompts x G
        assert set(dict(rows(home, "SELECT reward_name, count(*) FROM rewards WHERE task = 'gsm8k' GROUP BY 1"))) == {"math_answer", "format", "total"}
        checkpoint = res["model_store"].latest("grpo_checkpoint")
        assert checkpoint.manifest["tasks"] == {"gsm8k": 1.0, ARITHMETIC: 1.0}
        assert policy_tasks(checkpoint.path) == {"gsm8k": 1.0, ARITHMETIC: 1.0}  # in the checkpoint itself: what the Bento serves
        client = res["mlflow"].client()
        run_id = checkpoint.manifest["mlflow_run_id"]
        curves = [name for name in client.get_run(run_id).data.metrics if name.startswith("task/")]
        drawn = {name.split("/")[1] for name in curves if name.endswith("/groups")}
        assert drawn <= {"gsm8k", ARITHMETIC} and drawn  # per-task curves of the tasks each step drew
        for task in drawn:
            assert [m.step for m in client.get_metric_history(run_id, f"task/{task}/reward_mean")]

        base = res["model_store"].latest("base_policy")
        for task in ("gsm8k", ARITHMETIC):
            key = MultiPartitionKey({"task": task, "policy": policy_key("base_policy", base.version)})
            evaluated = materialize(
                [tasks.task_evaluation], resources=res, run_config={"ops": {"task_evaluation": {"config": PROTOCOL}}}, instance=instance, partition_key=key
            )
            assert evaluated.success
            meta = evaluated.asset_materializations_for_node("task_evaluation")[0].metadata
            assert meta["task"].value == task and meta["reused"].value is False
        assert dict(rows(home, "SELECT task, count(*) FROM eval_results GROUP BY 1")) == {"gsm8k": 4, ARITHMETIC: 4}

        report = materialize([tasks.cross_task_report], resources=res, run_config={"ops": {"cross_task_report": {"config": PROTOCOL}}}, instance=instance)
        assert report.success
        meta = report.asset_materializations_for_node("cross_task_report")[0].metadata
        assert meta["tasks"].value == 2 and "macro average" in meta["table"].value and "![pass@1 per task]" in meta["plot"].value
        assert dict(rows(home, "SELECT policy_role, count(*) FROM eval_results GROUP BY 1")) == {"base_policy": 8, "grpo_checkpoint": 8}  # base reused
        eval_run = client.search_runs([client.get_experiment_by_name("rlvr-ops").experiment_id], "tags.`rlvr.kind` = 'cross_task_report'")[0]
        assert {"gsm8k.delta", f"{ARITHMETIC}.delta", "macro.delta"} <= set(eval_run.data.metrics)


def test_a_mixture_refuses_unknown_and_test_set_tasks_and_never_trains_on_held_out_questions(home, gsm8k_dir, tiny_llama_dir):
    res = resources_for(home)
    config = run_config(gsm8k_dir, tiny_llama_dir, steps=1)
    with DagsterInstance.ephemeral() as instance:
        ops = {k: v for k, v in config["ops"].items() if k in ("gsm8k_problems", "base_policy")}
        assert materialize([data.gsm8k_problems, models.base_policy], resources=res, run_config={"ops": ops}, instance=instance).success

        def train(**settings):
            grpo = {"config": {**config["ops"]["grpo_training"]["config"], **settings}}
            return materialize(
                [data.gsm8k_problems, models.base_policy, training.grpo_training],
                resources=res,
                run_config={"ops": {"grpo_training": grpo}},
                instance=instance,
                selection=[training.grpo_training],
                raise_on_error=False,
            )

        def failure(result):
            return result.failure_data_for_node("grpo_training").error.message

        assert "unknown task 'gsm9k'" in failure(train(tasks={"gsm9k": 1.0}))
        assert "test sets" in failure(train(tasks={"humaneval": 1.0}))
        assert "never feeds training" in failure(train(split="test"))
        assert not res["model_store"].latest("grpo_checkpoint")

        # a training task whose questions are GSM8k test questions: left out, so nothing is left to train on
        test_questions = [q for (q,) in rows(home, "SELECT question FROM gsm8k_problems WHERE split = 'test'")]
        leaked = [TaskProblem("echo_leak", f"l{i}", "train", q.upper(), {"target": "x"}).as_row() for i, q in enumerate(test_questions)]
        res["duckdb"].write(Upsert("task_problems", pd.DataFrame(leaked), "task"))
        register_task(Task(name="echo_leak", load=lambda o: [], correctness="exact_match", rewards={"exact_match": 1.0}))
        assert "no training problems left after removing held-out questions" in failure(train(tasks={"echo_leak": 1.0}))
