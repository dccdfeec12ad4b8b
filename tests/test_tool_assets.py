"""Tool calling through the assets: a policy trained with ``environment: calculator`` records it in its
lineage, its rollouts' tool calls land in ``tool_calls`` beside ``rollouts`` (counts that agree), and
evaluation runs each policy in its own environment (or the protocol's) with per-problem tool counts.

The policy is the scripted calculator Llama (``support.scripted_policies.save_calculator_llama``): every
completion calls the tool, some calls fail (``9/0``), and what lands in DuckDB can be checked call by call."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from dagster import DagsterInstance, materialize

from rlvr import policy
from rlvr.environments import Calculator
from rlvr.policy import stored_environment
from rlvr_assets import data, evaluation, models, sft, training
from support.pipeline import resources_for
from support.scripted_policies import GREEDY_WITH_CALCULATOR, GREEDY_WITHOUT_TOOL, save_calculator_llama

pytestmark = pytest.mark.slow  # materializes Dagster assets and trains

ROOT = Path(__file__).resolve().parents[1]
CALCULATOR = {"name": "calculator", "max_calls": 4}
PROTOCOL = {"limit": 3, "max_new_tokens": 24, "batch_rows": 8}
CALLS = {"6*7": ("42", False), "9/0": ("error", True)}  # expression -> (result written back, failed)


def run_config(gsm8k_dir, model_dir, environment: dict | None = CALCULATOR, protocol: dict = PROTOCOL) -> dict:
    grpo = {
        "overrides": {"total_steps": 2, "prompts_per_step": 2, "group_size": 4, "checkpoint_every": 1, "sampling": {"max_new_tokens": 24}},
        **({"environment": environment} if environment is not None else {}),
    }
    return {
        "ops": {
            "gsm8k_problems": {"config": {"local_dir": str(gsm8k_dir), "limit": 12}},
            "base_policy": {"config": {"model": str(model_dir)}},
            "grpo_training": {"config": grpo},
            "baseline_eval": {"config": protocol},
            "eval_report": {"config": protocol},
        }
    }


def query(home: Path, sql: str, params: list | None = None) -> list[tuple]:
    with duckdb.connect(str(home / "rlvr.duckdb"), read_only=True) as conn:
        return conn.execute(sql, params or []).fetchall()


def test_the_script_calls_the_calculator(tmp_path):
    """The scripted policy does what the other tests rely on, through the real engine."""
    from rlvr.generation import SamplingConfig, generate_rollouts
    from rlvr.policy import load_policy
    from rlvr.tasks.gsm8k.prompt import render_prompt, system_prompt_for

    model, tokenizer = load_policy(save_calculator_llama(tmp_path / "calc"))
    prompt = render_prompt(tokenizer, "What is 6 times 7?", system_prompt_for(Calculator()))
    assert Calculator.instructions in prompt
    plain = generate_rollouts(model, tokenizer, [prompt], 1, SamplingConfig(max_new_tokens=24, temperatures=[0.0]))
    assert plain.texts == [GREEDY_WITHOUT_TOOL] and plain.tool_calls == [[]]
    tool = generate_rollouts(model, tokenizer, [prompt, "A:"], 1, SamplingConfig(max_new_tokens=24, temperatures=[0.0], environment=Calculator()))
    assert tool.texts == [GREEDY_WITH_CALCULATOR, " <<9/0=error>> #### 42"]
    assert [(c.call, c.result, c.error is not None) for calls in tool.tool_calls for c in calls] == [("6*7", "42", False), ("9/0", "error", True)]


def test_a_calculator_run_stores_its_tool_calls_lineage_and_evaluation(home, gsm8k_dir, tmp_path):
    res = resources_for(home)
    model_dir = save_calculator_llama(tmp_path / "calc")
    config = run_config(gsm8k_dir, model_dir)
    assets = [data.gsm8k_problems, models.base_policy, training.grpo_training, evaluation.baseline_eval, evaluation.eval_report]
    with DagsterInstance.ephemeral() as instance:
        result = materialize(assets, resources=res, run_config=config, instance=instance)
        assert result.success

        # lineage: the checkpoint, its manifest and its MLflow run name the environment
        trained = res["model_store"].latest("grpo_checkpoint")
        spec = trained.manifest["environment"]
        assert spec["name"] == "calculator" and spec["options"]["max_calls"] == 4
        assert stored_environment(trained.path) == spec
        assert stored_environment(res["model_store"].latest("base_policy").path)["name"] == "single_turn"
        training_run = res["mlflow"].client().get_run(trained.manifest["mlflow_run_id"])
        assert training_run.data.tags["rlvr.environment"] == "calculator"

        # rollouts and tool_calls agree, completion by completion
        rollouts = query(home, "SELECT completion_id, completion, tool_calls, policy_tokens, environment_tokens, completion_tokens FROM rollouts")
        assert len(rollouts) == 2 * 2 * 4
        calls = query(home, "SELECT completion_id, call_index, tool, call, result, error, latency_s, step, run_id FROM tool_calls ORDER BY 1, 2")
        per_completion: dict[str, list[tuple]] = {}
        for row in calls:
            per_completion.setdefault(row[0], []).append(row)
        tokenizer = policy.load_tokenizer(model_dir)
        for completion_id, completion, count, policy_tokens, environment_tokens, completion_tokens in rollouts:
            made = per_completion.get(completion_id, [])
            assert count == len(made) >= 1, completion  # the script always calls
            assert [c[1] for c in made] == list(range(count))
            assert policy_tokens + environment_tokens == completion_tokens
            assert environment_tokens == sum(len(tokenizer(c[4] + ">>", add_special_tokens=False).input_ids) for c in made)
            for _, _, tool, call, written, error, latency_s, step, run_id in made:
                assert tool == "calculator" and latency_s >= 0 and completion_id.startswith(f"{run_id}:{step}:")
                assert (written, error is not None) == CALLS[call]
                assert f"<<{call}={written}>>" in completion
        assert {c[3] for c in calls} <= set(CALLS)

        meta = result.asset_materializations_for_node("grpo_training")
        rollouts_meta = next(m for m in meta if m.asset_key.to_user_string() == "rollouts").metadata
        errors = sum(c[5] is not None for c in calls)
        assert 0 < errors < len(calls)  # sampled past the branch after '<<' both ways (seeded: the same every run)
        assert rollouts_meta["environment"].value == "calculator" and rollouts_meta["tool_calls"].value == len(calls)
        assert rollouts_meta["completions calling a tool (%)"].value == 100.0
        assert rollouts_meta["tool call errors (%)"].value == pytest.approx(round(100 * errors / len(calls), 1))

        # the documented query (docs/configuration.md): how often the policy used the calculator and whether its calls were right
        doc = (ROOT / "docs" / "configuration.md").read_text()
        sql = doc.split("how often rightly, by step:\n\n```sql\n", 1)[1].split("```", 1)[0]
        by_step = query(home, sql)
        assert len(by_step) == 2 and all(r[1] == 1.0 and r[2] >= 2 * 4 for r in by_step)  # every completion of a step calls
        assert sum(r[2] for r in by_step) == len(calls)
        assert sum(r[3] * r[2] for r in by_step) == pytest.approx(len(calls) - errors)

        # evaluation: each policy in its own environment, tool use per problem
        evals = query(home, "SELECT policy_role, environment, tool_calls, tool_errors, completion FROM eval_results ORDER BY 1, problem_id")
        base_rows, trained_rows = [r for r in evals if r[0] == "base_policy"], [r for r in evals if r[0] == "grpo_checkpoint"]
        assert base_rows == [("base_policy", "single_turn", 0, 0, GREEDY_WITHOUT_TOOL)] * PROTOCOL["limit"]
        assert trained_rows == [("grpo_checkpoint", "calculator", 1, 0, GREEDY_WITH_CALCULATOR)] * PROTOCOL["limit"]
        report = result.asset_materializations_for_node("eval_report")[0].metadata
        assert report["environment"].value == "calculator"
        assert report["completions calling a tool (%)"].value == 100.0 and report["tool calls per completion"].value == 1
        assert report["tool call errors (%)"].value == 0.0
        baseline = result.asset_materializations_for_node("baseline_eval")[0].metadata
        assert baseline["environment"].value == "single_turn" and "completions calling a tool (%)" not in baseline

        # a protocol may override the environment: the base policy evaluated with the calculator
        override = {**PROTOCOL, "environment": {"name": "calculator", "max_calls": 1}}
        again = materialize([evaluation.baseline_eval], resources=res, run_config={"ops": {"baseline_eval": {"config": override}}}, instance=instance)
        meta = again.asset_materializations_for_node("baseline_eval")[0].metadata
        assert meta["environment"].value == "calculator" and meta["reused"].value is False  # its own evaluation, not the single-turn one
        assert meta["eval_id"].value != baseline["eval_id"].value
        rows = query(home, "SELECT tool_calls, tool_errors, completion FROM eval_results WHERE eval_id = ?", [meta["eval_id"].value])
        assert rows == [(1, 0, GREEDY_WITH_CALCULATOR)] * PROTOCOL["limit"]


@pytest.mark.parametrize(
    "environment, named",
    [({"name": "abacus"}, "unknown environment 'abacus'"), ({"name": "calculator", "max_cals": 3}, "max_cals")],
)
def test_a_bad_environment_fails_before_any_work_and_loses_nothing(home, gsm8k_dir, tiny_llama_dir, environment, named):
    res = resources_for(home)
    config = run_config(gsm8k_dir, tiny_llama_dir, environment=None)
    config["ops"]["grpo_training"]["config"]["overrides"]["total_steps"] = 1
    config["ops"] = {k: v for k, v in config["ops"].items() if k in ("gsm8k_problems", "base_policy", "grpo_training")}
    with DagsterInstance.ephemeral() as instance:
        assert materialize([data.gsm8k_problems, models.base_policy, training.grpo_training], resources=res, run_config=config, instance=instance).success
        stored = res["model_store"].latest("grpo_checkpoint")
        before = {t: query(home, f"SELECT count(*) FROM {t}")[0][0] for t in ("rollouts", "rewards", "tool_calls")}
        assert before["tool_calls"] == 0 and stored.manifest["environment"] == {"name": "single_turn", "options": {}}
        runs = len(res["mlflow"].client().search_runs([res["mlflow"].experiment_id()]))

        config["ops"]["grpo_training"]["config"]["environment"] = environment
        ops = {"grpo_training": config["ops"]["grpo_training"]}
        failed = materialize([training.grpo_training], resources=res, run_config={"ops": ops}, instance=instance, raise_on_error=False)
        assert not failed.success
        (failure,) = [e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"]
        message = failure.step_failure_data.user_failure_data.description
        assert message.startswith("grpo_training: bad run config: environment") and named in message
        protocol = {**PROTOCOL, "environment": environment}
        ops = {"baseline_eval": {"config": protocol}}
        bad_eval = materialize([evaluation.baseline_eval], resources=res, run_config={"ops": ops}, instance=instance, raise_on_error=False)
        assert not bad_eval.success
        (failure,) = [e for e in bad_eval.all_events if e.event_type_value == "STEP_FAILURE"]
        assert named in failure.step_failure_data.user_failure_data.description

        assert res["model_store"].latest("grpo_checkpoint").version == stored.version
        assert {t: query(home, f"SELECT count(*) FROM {t}")[0][0] for t in before} == before
        assert query(home, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'eval_results'") == [(0,)]  # nothing evaluated
        assert len(res["mlflow"].client().search_runs([res["mlflow"].experiment_id()])) == runs  # no run started


def test_sft_with_the_calculator_keeps_annotations_and_records_the_environment(home, gsm8k_dir, tmp_path):
    res = resources_for(home)
    model_dir = save_calculator_llama(tmp_path / "calc")
    ops = {k: v for k, v in run_config(gsm8k_dir, model_dir)["ops"].items() if k in ("gsm8k_problems", "base_policy")}
    ops["sft_policy"] = {
        "config": {"environment": CALCULATOR, "overrides": {"total_steps": 1, "batch_size": 2, "micro_batch_size": 2, "max_completion_tokens": 32}}
    }
    with DagsterInstance.ephemeral() as instance:
        result = materialize([data.gsm8k_problems, models.base_policy, sft.sft_policy], resources=res, run_config={"ops": ops}, instance=instance)
    assert result.success
    stored = res["model_store"].latest("sft_policy")
    assert stored.manifest["sft_config"]["keep_calculator_annotations"] is True
    assert stored.manifest["environment"] == stored_environment(stored.path) == {"name": "calculator", "options": {**Calculator().options(), "max_calls": 4}}
