"""The warehouse's declared tables: their columns (:data:`SCHEMAS`), the columns added since
(:data:`MIGRATIONS`), every task's problems table and the older names kept as its views."""

from __future__ import annotations

from rlvr.tasks.gsm8k import NAME as GSM8K_NAME

SCHEMAS = {
    "serving_traffic": """CREATE TABLE IF NOT EXISTS serving_traffic (
  record_id VARCHAR PRIMARY KEY, "timestamp" TIMESTAMPTZ, request_id VARCHAR, endpoint VARCHAR, model_version VARCHAR, task VARCHAR,
  status INTEGER, latency_s DOUBLE, prompt VARCHAR, answer VARCHAR, vote_share DOUBLE, num_completions INTEGER,
  well_formed DOUBLE, completion_chars DOUBLE, completion_tokens DOUBLE, truncated DOUBLE, ground_truth VARCHAR,
  mean_reward DOUBLE, best_reward DOUBLE, source_file VARCHAR, source_offset BIGINT, api_key_id VARCHAR,
  prompt_tokens BIGINT, generated_tokens BIGINT, compute_s DOUBLE)""",
    "serving_traffic_cursor": 'CREATE TABLE IF NOT EXISTS serving_traffic_cursor (file VARCHAR PRIMARY KEY, "offset" BIGINT)',
    "drift_history": "CREATE TABLE IF NOT EXISTS drift_history (reported_at TIMESTAMPTZ, run_id VARCHAR, metric VARCHAR, "
    "value DOUBLE, threshold DOUBLE, drifted BOOLEAN, day VARCHAR, task VARCHAR)",
    # one row per tool call an environment answered in a rollout (error NULL: the call succeeded)
    # the cost ledger (resources.costs): one row per asset materialization, training step (per task) and evaluation
    "costs": """CREATE TABLE IF NOT EXISTS costs (
  cost_id VARCHAR PRIMARY KEY, recorded_at TIMESTAMPTZ, run_id VARCHAR, root_run_id VARCHAR, asset VARCHAR, "partition" VARCHAR,
  step INTEGER, task VARCHAR, scope VARCHAR, machine VARCHAR, policy_version VARCHAR, wall_s DOUBLE, cpu_core_s DOUBLE, gpu_s DOUBLE,
  peak_rss_mb DOUBLE, peak_gpu_mem_mb DOUBLE, energy_kwh DOUBLE, energy_source VARCHAR, prompt_tokens BIGINT, completion_tokens BIGINT,
  trained_tokens BIGINT)""",
    "tool_calls": "CREATE TABLE IF NOT EXISTS tool_calls (run_id VARCHAR, completion_id VARCHAR, step INTEGER, call_index INTEGER, "
    "tool VARCHAR, call VARCHAR, result VARCHAR, error VARCHAR, latency_s DOUBLE, PRIMARY KEY (completion_id, call_index))",
}
MIGRATIONS = {  # columns added since a table was first declared: an older database gains them (empty) on its next write
    "drift_history": [f"ALTER TABLE drift_history ADD COLUMN IF NOT EXISTS {c} VARCHAR" for c in ("day", "task")],
    "serving_traffic": [
        *(f"ALTER TABLE serving_traffic ADD COLUMN IF NOT EXISTS {c} VARCHAR" for c in ("api_key_id", "task")),
        *(f"ALTER TABLE serving_traffic ADD COLUMN IF NOT EXISTS {c} BIGINT" for c in ("prompt_tokens", "generated_tokens")),
        "ALTER TABLE serving_traffic ADD COLUMN IF NOT EXISTS compute_s DOUBLE",
    ],
    "rollouts": [f"ALTER TABLE rollouts ADD COLUMN IF NOT EXISTS {c} BIGINT" for c in ("policy_tokens", "environment_tokens", "tool_calls")],
    "eval_results": [
        "ALTER TABLE eval_results ADD COLUMN IF NOT EXISTS environment VARCHAR",
        *(f"ALTER TABLE eval_results ADD COLUMN IF NOT EXISTS {c} BIGINT" for c in ("tool_calls", "tool_errors")),
    ],
}
PROBLEMS = "task_problems"  # every task's problems, one row each: task, id, split, question, reference (JSON), source, hashes
PROBLEM_VIEWS = {  # a task whose problems had a table of their own in older files: the view that keeps its name and columns
    GSM8K_NAME: (
        "gsm8k_problems",
        "CREATE OR REPLACE VIEW gsm8k_problems AS SELECT problem_id, split, question, reference->>'$.solution' AS solution, "
        "reference->>'$.answer_text' AS answer_text, CAST(reference->>'$.answer_value' AS DOUBLE) AS answer_value, num_steps, source, "
        f"content_hash, task, reference, question_hash FROM {PROBLEMS} WHERE task = '{GSM8K_NAME}'",
    )
}
WRITER_POOL = "duckdb_writer"  # the Dagster pool of every asset that writes the file; the instance runs one step of it at a time (deploy/)
