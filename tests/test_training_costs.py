"""The cost ledger of GRPO training and its budgets: every step's usage per task in the ``costs`` table (tokens
exact, compute measured), a run stopped at the step its budget runs out (checkpoint kept, resumable with a
larger budget), and a money budget refused without prices."""

from __future__ import annotations

import resource

import pytest
from dagster import DagsterInstance, ReexecutionOptions, execute_job, materialize

from rlvr.costs import Prices, Usage
from rlvr.costs.budget import Budget, Spend, spend_of
from rlvr.training_run import task_usages
from rlvr_assets import data, models, training
from support.pipeline import resources_for, run_config
from support.training_jobs import rows, training_job


def training_config(gsm8k_dir, model_dir, steps: int, budget: dict | None = None, nproc: str = "1") -> dict:
    config = run_config(gsm8k_dir, model_dir, steps=steps)
    config["ops"]["grpo_training"]["config"]["nproc"] = nproc
    if budget is not None:
        config["ops"]["grpo_training"]["config"]["budget"] = budget
    return {"ops": {k: v for k, v in config["ops"].items() if k in ("gsm8k_problems", "base_policy", "grpo_training")}}


def failure_message(result) -> str:
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return failure.event_specific_data.error.message


# --- the budget and the split of a step over its tasks ---------------------------------------------------


def test_a_budget_is_reached_by_the_first_limit_spent():
    budget = Budget(core_hours=2.0, usd=1.0, prices=Prices(core_hour=0.25))
    assert budget.reached(Spend(core_hours=1.9, usd=0.9)) is None
    assert budget.reached(Spend(core_hours=2.0)) == "budget core_hours 2 reached: spent 2 core-hours"
    assert budget.reached(Spend(core_hours=0.5, usd=1.2)) == "budget usd 1 reached: spent 1.2 usd"
    assert Budget.from_dict(budget.as_dict()) == budget
    assert not Budget().is_set and Budget().reached(Spend(core_hours=1e9)) is None


def test_a_budget_refuses_bad_limits_and_money_without_prices():
    for bad in (0, -1.0, "2", True):
        with pytest.raises(ValueError, match="budget.gpu_hours must be a positive number"):
            Budget(gpu_hours=bad)
    with pytest.raises(ValueError, match="budget.usd needs prices"):
        Budget(usd=5.0, prices=Prices())


def test_spend_sums_hours_and_prices_each_usage():
    usages = [Usage(cpu_core_s=3600, gpu_s=1800, peak_rss_mb=1024, wall_s=3600), Usage(cpu_core_s=1800)]
    spend = spend_of(usages, Prices(core_hour=2.0, gpu_hour=10.0, memory_gb_hour=1.0))
    assert spend == Spend(core_hours=1.5, gpu_hours=0.5, usd=2.0 + 5.0 + 1.0 + 1.0)
    assert spend_of(usages, Prices()).usd == 0.0


def test_a_step_is_split_over_its_tasks_by_their_tokens():
    def record(task, prompt, completion, trained, policy=None):
        return {"task": task, "prompt_tokens": prompt, "completion_tokens": completion, "policy_tokens": policy or completion, "trained": trained}

    records = [record("gsm8k", 10, 20, True), record("gsm8k", 10, 30, False), record("math", 5, 25, True, policy=15)]
    usage = Usage(wall_s=10.0, cpu_core_s=100.0, gpu_s=10.0, peak_rss_mb=500.0, energy_kwh=1.0)
    split = task_usages(usage, records)
    assert split["gsm8k"].cpu_core_s == pytest.approx(70.0) and split["math"].cpu_core_s == pytest.approx(30.0)
    assert (split["gsm8k"].prompt_tokens, split["gsm8k"].completion_tokens, split["gsm8k"].trained_tokens) == (20, 50, 20)
    assert (split["math"].prompt_tokens, split["math"].completion_tokens, split["math"].trained_tokens) == (5, 25, 15)
    assert split["math"].peak_rss_mb == 500.0  # a peak is not shared out


# --- the ledger and budgets of Dagster runs ------------------------------------------------------------------


def cpu_seconds_so_far() -> float:
    """CPU seconds of this process and of every child it reaped (torchrun, and through it the ranks and reward workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.mark.slow  # materializes GRPO training
def test_each_step_of_a_run_is_in_the_costs_table(home, gsm8k_dir, tiny_llama_dir):
    res = resources_for(home)
    before = cpu_seconds_so_far()
    with DagsterInstance.ephemeral() as instance:
        result = materialize(
            [data.gsm8k_problems, models.base_policy, training.grpo_training],
            resources=res,
            run_config=training_config(gsm8k_dir, tiny_llama_dir, 2),
            instance=instance,
        )
    used = cpu_seconds_so_far() - before
    assert result.success
    columns = "step, task, run_id, root_run_id, asset, scope, policy_version, cpu_core_s, prompt_tokens, completion_tokens"
    ledger = rows(home, f"SELECT {columns} FROM costs WHERE scope = 'step' ORDER BY step")
    stored = res["model_store"].latest("grpo_checkpoint")
    assert [(r[0], r[1]) for r in ledger] == [(1, "gsm8k"), (2, "gsm8k")]  # one row per step and task
    assert {r[2:7] for r in ledger} == {(result.run_id, result.run_id, "grpo_checkpoint", "step", stored.version)}
    tokens = rows(home, f"SELECT step, sum(prompt_tokens), sum(completion_tokens) FROM rollouts WHERE run_id = '{result.run_id}' GROUP BY step ORDER BY step")
    assert [(r[0], r[8], r[9]) for r in ledger] == tokens
    spent = sum(r[7] for r in ledger)
    assert 0 < spent <= used
    metadata = {m.asset_key.to_user_string(): m.metadata for m in result.asset_materializations_for_node("grpo_training")}["grpo_checkpoint"]
    assert metadata["cost/cpu_core_s"].value == pytest.approx(spent)
    assert metadata["cost/tokens"].value == sum(r[1] + r[2] for r in tokens)
    mlflow_run = res["mlflow"].client().get_run(stored.manifest["mlflow_run_id"])
    assert mlflow_run.data.metrics["cost/cpu_core_s"] == pytest.approx(spent)
    assets = {
        r[0]: r[1:]
        for r in rows(home, f"SELECT asset, cpu_core_s, prompt_tokens, completion_tokens FROM costs WHERE scope = 'asset' AND run_id = '{result.run_id}'")
    }
    assert set(assets) == {"gsm8k_problems", "base_policy", "grpo_training"}  # the job's materializations, one row each
    assert spent <= assets["grpo_training"][0] and sum(a[0] for a in assets.values()) <= used  # steps within their asset, assets within the job
    assert assets["grpo_training"][1:] == (sum(r[1] for r in tokens), sum(r[2] for r in tokens))  # the training's tokens on its asset row


@pytest.mark.slow  # materializes GRPO training three times
def test_a_run_stops_when_its_budget_is_spent_and_resumes_with_a_larger_one(home, gsm8k_dir, tiny_llama_dir, tmp_path):
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        tiny = training_config(gsm8k_dir, tiny_llama_dir, 3, budget={"core_hours": 1e-9}, nproc="2")  # spent by step 1; two ranks agree
        stopped = execute_job(training_job(home), instance=instance, run_config=tiny)
        assert not stopped.success
        message = failure_message(stopped)
        assert "budget core_hours 1e-09 reached" in message and "at step 1 of 3" in message and "larger budget to resume" in message
        scratch = home / "models" / ".work" / "grpo-runs" / stopped.run_id
        assert (scratch / "checkpoints" / "latest").read_text().strip() == "step-000001"  # kept, though not due
        assert rows(home, "SELECT step, run_id FROM costs WHERE scope = 'step'") == [(1, stopped.run_id)]  # the finished step's rows were written

        again = execute_job(
            training_job(home), instance=instance, run_config=tiny, reexecution_options=ReexecutionOptions.from_failure(stopped.run_id, instance)
        )
        assert not again.success and "budget core_hours 1e-09 reached" in failure_message(again) and "at step 1 of 3" in failure_message(again)
        assert rows(home, "SELECT count(*) FROM costs WHERE scope = 'step'")[0][0] == 1  # refused before training: no step ran again

        larger = training_config(gsm8k_dir, tiny_llama_dir, 3, budget={"core_hours": 1000.0}, nproc="2")
        resumed = execute_job(
            training_job(home), instance=instance, run_config=larger, reexecution_options=ReexecutionOptions.from_failure(again.run_id, instance)
        )
        assert resumed.success
    ledger = rows(home, "SELECT step, run_id, root_run_id FROM costs WHERE scope = 'step' ORDER BY step")
    assert ledger == [(1, stopped.run_id, stopped.run_id), (2, resumed.run_id, stopped.run_id), (3, resumed.run_id, stopped.run_id)]
    assert rows(home, "SELECT step, count(*) FROM rollouts GROUP BY step ORDER BY step") == [(1, 4), (2, 4), (3, 4)]  # no step repeated
    stored = resources_for(home)["model_store"].latest("grpo_checkpoint")
    assert stored is not None and stored.manifest["root_run_id"] == stopped.run_id


def test_a_money_budget_without_prices_fails_before_training(home, monkeypatch):
    monkeypatch.setenv("RLVR_PRICES", "none")
    config = {"ops": {"grpo_training": {"config": {"budget": {"usd": 5.0}}}}}
    result = materialize([training.grpo_training], resources=resources_for(home), run_config=config, raise_on_error=False)
    assert not result.success
    assert "budget.usd needs prices" in failure_message(result)
    assert resources_for(home)["model_store"].latest("base_policy") is None and not rows_exist(home)


def rows_exist(home) -> bool:
    """Whether any training wrote its scratch folder."""
    return (home / "models" / ".work" / "grpo-runs").exists()
