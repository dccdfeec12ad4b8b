#!/usr/bin/env bash
# Reproduce docs/results.md: the whole pipeline on the embedded model, one experiment per config in
# bench/results/, each in its own data directory (.rlvr-results/<name>), then its result table.
#   bash bench/results.sh            # gsm8k and products (about 2 hours 10 minutes on 2 CPU cores)
#   bash bench/results.sh products   # one of them
#   bash bench/results.sh gsm8k_sft  # experiment 5 (its .sft, .eval and .full configs: about 2.5 hours)
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
export VIRTUAL_ENV="$PWD/.venv"  # dg runs in the project's environment
evaluate() {  # the latest stored version of policy $1 under run config $2: its policy_evaluation partition
  .venv/bin/dg launch --assets policy_evaluation --partition "$1/$(cat "$RLVR_HOME/models/$1/LATEST")" --config "$2"
}
for experiment in "${@:-gsm8k products}"; do
  export RLVR_HOME="$PWD/.rlvr-results/$experiment" DAGSTER_HOME="$PWD/.rlvr-results/$experiment/dagster"
  export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
  make --no-print-directory "$DAGSTER_HOME/dagster.yaml" DAGSTER_HOME="$DAGSTER_HOME" >/dev/null
  started=$(date +%s)
  if [ -f "bench/results/$experiment.sft.yaml" ]; then  # an SFT cold start first (GRPO then starts from it)
    .venv/bin/dg launch --assets gsm8k_problems,base_policy,sft_policy --config "bench/results/$experiment.sft.yaml"
  fi
  .venv/bin/dg launch --job rlvr_pipeline --config "bench/results/$experiment.yaml"
  if [ -f "bench/results/$experiment.eval.yaml" ]; then  # the SFT policy on the same problems, as its own partition
    evaluate sft_policy "bench/results/$experiment.eval.yaml"
  fi
  if [ -f "bench/results/$experiment.full.yaml" ]; then  # every stage's policy on the whole test split, each its own partition
    for policy in sft_policy grpo_checkpoint base_policy; do
      [ -f "$RLVR_HOME/models/$policy/LATEST" ] || continue
      evaluate "$policy" "bench/results/$experiment.full.yaml"
    done
  fi
  echo "pipeline wall time: $(( $(date +%s) - started )) s"
  .venv/bin/python bench/results_table.py
done
