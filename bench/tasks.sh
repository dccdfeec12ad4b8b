#!/usr/bin/env bash
# docs/benchmarks.md, "Tasks": the embedded model on each shipped task (base policy), a short GRPO run on a
# mixture of three tasks, and the cross-task report of base vs trained, in .rlvr-tasks (about 40 minutes
# on 2 CPU cores). Prints the table (bench/tasks_table.py).
#   bash bench/tasks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
export VIRTUAL_ENV="$PWD/.venv" RLVR_HOME="$PWD/.rlvr-tasks" DAGSTER_HOME="$PWD/.rlvr-tasks/dagster"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export RLVR_TASKS="gsm8k,humaneval,reasoning_gym:basic_arithmetic,reasoning_gym:spell_backward"
make --no-print-directory "$DAGSTER_HOME/dagster.yaml" DAGSTER_HOME="$DAGSTER_HOME" >/dev/null
dg=.venv/bin/dg
started=$(date +%s)
$dg launch --assets gsm8k_problems,base_policy --config bench/tasks/problems.yaml
$dg launch --assets task_problems --partition humaneval --config bench/tasks/humaneval.yaml
for task in reasoning_gym:basic_arithmetic reasoning_gym:spell_backward; do
  $dg launch --assets task_problems --partition "$task" --config bench/tasks/reasoning_gym.yaml
done
base="base_policy/$(cat "$RLVR_HOME/models/base_policy/LATEST")"
for task in ${RLVR_TASKS//,/ }; do
  $dg launch --assets task_evaluation --partition "$base|$task" --config bench/tasks/protocol.yaml  # <policy>|<task>
done
$dg launch --assets rollouts,rewards,grpo_checkpoint --config bench/tasks/mixture.yaml
$dg launch --assets cross_task_report --config bench/tasks/report.yaml
echo "wall time: $(( $(date +%s) - started )) s"
.venv/bin/python bench/tasks_table.py
