"""rlvr: the RL core of rlvr-ops (answers, prompts, rewards, rollouts, GRPO, evaluation).

A plain library: it never imports Dagster, DuckDB, MLflow or BentoML.
"""
