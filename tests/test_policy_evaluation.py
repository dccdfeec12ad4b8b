"""policy_evaluation: one dynamic partition per stored policy, added when it is stored, requested by
declarative automation while missing (also a policy stored before the daemon's first tick), evaluated
into a real DuckDB file and MLflow store, re-evaluated on request, and computed once when two runs ask
for the same evaluation at once."""

from concurrent.futures import ThreadPoolExecutor

import duckdb
import pytest
from dagster import DagsterInstance, Definitions, evaluate_automation_conditions, materialize

from resources import EvalProtocol
from rlvr.tasks import DEFAULT_TASK
from rlvr_assets import data, evaluation, models
from rlvr_assets.partitions import parse_policy_key, policy_key, policy_versions
from support.pipeline import PROTOCOL, resources_for, run_config

pytestmark = pytest.mark.slow  # materializes Dagster assets


def evaluate(instance, res, key, **config):
    return materialize(
        [data.gsm8k_problems, models.base_policy, evaluation.policy_evaluation],
        resources=res,
        run_config={"ops": {"policy_evaluation": {"config": {**PROTOCOL, **config}}}},
        instance=instance,
        partition_key=key,
        selection=[evaluation.policy_evaluation],
        raise_on_error=False,
    )


def test_a_stored_policy_gets_its_partition_and_its_own_evaluation(home, gsm8k_dir, tiny_llama_dir):
    res = resources_for(home)
    with DagsterInstance.ephemeral() as instance:
        defs = Definitions(assets=[data.gsm8k_problems, models.base_policy, evaluation.policy_evaluation], resources=res)
        ops = {k: v for k, v in run_config(gsm8k_dir, tiny_llama_dir)["ops"].items() if k in ("gsm8k_problems", "base_policy")}
        assert materialize([data.gsm8k_problems, models.base_policy], resources=res, run_config={"ops": ops}, instance=instance).success
        key = policy_key("base_policy", res["model_store"].latest("base_policy").version)
        assert instance.get_dynamic_partitions(policy_versions.name) == [key]

        # declarative automation: the daemon's first tick (no cursor: it starts after the policy was stored)
        # requests the missing partition of the policy, and only it
        automation = evaluate_automation_conditions(defs=defs, instance=instance)
        requested = automation.get_requested_partitions(evaluation.policy_evaluation.key)
        assert requested == {key}

        first = evaluate(instance, res, key)
        assert first.success
        meta = first.asset_materializations_for_node("policy_evaluation")[0].metadata
        assert meta["policy"].value == "base_policy" and meta["reused"].value is False and "pass@1 strict (%)" in meta
        with duckdb.connect(str(home / "rlvr.duckdb"), read_only=True) as conn:
            assert conn.execute("SELECT policy_role, count(*) FROM eval_results GROUP BY 1").fetchall() == [("base_policy", PROTOCOL["limit"])]
        run = res["mlflow"].client().get_run(meta["mlflow_run_id"].value)
        assert run.data.tags["rlvr.kind"] == "policy_evaluation" and "pass_at_1_strict" in run.data.metrics

        again = evaluate(instance, res, key)
        assert again.asset_materializations_for_node("policy_evaluation")[0].metadata["reused"].value is True
        recomputed = evaluate(instance, res, key, recompute=True)
        assert recomputed.asset_materializations_for_node("policy_evaluation")[0].metadata["reused"].value is False
        with duckdb.connect(str(home / "rlvr.duckdb"), read_only=True) as conn:  # replaced, not appended
            assert conn.execute("SELECT count(*) FROM eval_results").fetchone()[0] == PROTOCOL["limit"]
        after = evaluate_automation_conditions(defs=defs, instance=instance, cursor=automation.cursor)
        assert after.get_requested_partitions(evaluation.policy_evaluation.key) == set()  # evaluated: no longer missing


def test_a_malformed_or_unknown_policy_partition_fails_clearly(home, gsm8k_dir, tiny_llama_dir):
    with pytest.raises(ValueError, match="is not '<base_policy|sft_policy|grpo_checkpoint>/<version>'"):
        parse_policy_key("checkpoint-7")
    assert parse_policy_key(policy_key("grpo_checkpoint", "abc")) == ("grpo_checkpoint", "abc")
    res = resources_for(home)
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions(policy_versions.name, ["grpo_checkpoint/0123456789abcdef"])
        result = evaluate(instance, res, "grpo_checkpoint/0123456789abcdef")
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "grpo_checkpoint 0123456789abcdef is not in the model store" in failure.event_specific_data.error.message


def test_the_same_evaluation_asked_for_twice_at_once_is_computed_once(home, gsm8k_dir, tiny_llama_dir):
    """baseline_eval and policy_evaluation of the base policy started together: one computes, the other
    waits for it and reuses its rows; the rows name the policy, whatever part it plays in a report."""
    res = resources_for(home)
    ops = {k: v for k, v in run_config(gsm8k_dir, tiny_llama_dir)["ops"].items() if k in ("gsm8k_problems", "base_policy")}
    with DagsterInstance.ephemeral() as instance:
        assert materialize([data.gsm8k_problems, models.base_policy], resources=res, run_config={"ops": ops}, instance=instance).success
    base, protocol = res["model_store"].latest("base_policy"), EvalProtocol(**PROTOCOL)
    problems = res["duckdb"].task_problems(DEFAULT_TASK, protocol.split, protocol.limit)
    with ThreadPoolExecutor(2) as pool:
        both = [pool.submit(res["evaluator"].evaluate, "base_policy", base.version, base.path, protocol, problems) for _ in range(2)]
        outcomes = [future.result(timeout=300) for future in both]
    assert sorted(o.reused for o in outcomes) == [False, True] and outcomes[0].eval_id == outcomes[1].eval_id
    with duckdb.connect(str(home / "rlvr.duckdb"), read_only=True) as conn:
        assert conn.execute("SELECT policy_role, count(*) FROM eval_results GROUP BY 1").fetchall() == [("base_policy", PROTOCOL["limit"])]


def test_an_older_data_directory_with_its_gsm8k_problems_table_evaluates_as_before(home, gsm8k_dir, tiny_llama_dir):
    """A file written before every task's problems shared ``task_problems``: its ``gsm8k_problems`` table moves
    into it on the first read, and the evaluation stored before is found again (same problems, same identity)."""
    res = resources_for(home)
    with DagsterInstance.ephemeral() as instance:
        ops = {k: v for k, v in run_config(gsm8k_dir, tiny_llama_dir)["ops"].items() if k in ("gsm8k_problems", "base_policy")}
        assert materialize([data.gsm8k_problems, models.base_policy], resources=res, run_config={"ops": ops}, instance=instance).success
        key = policy_key("base_policy", res["model_store"].latest("base_policy").version)
        assert evaluate(instance, res, key).success
        with duckdb.connect(str(home / "rlvr.duckdb")) as conn:  # back to the older layout: GSM8k's rows in a table of their own
            older = conn.execute("SELECT * EXCLUDE (task, reference, question_hash) FROM gsm8k_problems").df()
            conn.execute("DROP VIEW gsm8k_problems")
            conn.execute("DELETE FROM task_problems")
            conn.execute("CREATE TABLE gsm8k_problems AS SELECT * FROM older")
        again = evaluate(instance, res, key)
        assert again.success and again.asset_materializations_for_node("policy_evaluation")[0].metadata["reused"].value is True
        with duckdb.connect(str(home / "rlvr.duckdb"), read_only=True) as conn:
            kind = conn.execute("SELECT table_type FROM information_schema.tables WHERE table_name = 'gsm8k_problems'").fetchone()[0]
            moved = conn.execute("SELECT count(*) FROM task_problems WHERE task = 'gsm8k'").fetchone()[0]
        assert kind == "VIEW" and moved == len(older)
