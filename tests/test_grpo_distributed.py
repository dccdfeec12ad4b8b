"""GRPO under torchrun: two CPU processes (gloo) end with identical weights, and learn."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlvr.grpo.checkpoint import read_trainer_state

pytestmark = pytest.mark.slow  # trains under torchrun

WORKER = Path(__file__).parent / "support" / "grpo_ddp_worker.py"  # imports support.tiny_models: tests/ goes on its PYTHONPATH


def test_two_ranks_end_identical_and_learn(tmp_path):
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [*torchrun, str(WORKER), str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    rank0, rank1 = (torch.load(tmp_path / f"weights-rank{r}.pt") for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)

    history0, history1 = (json.loads((tmp_path / f"history-rank{r}.json").read_text()) for r in (0, 1))
    assert [h["reward_mean"] for h in history0] == [h["reward_mean"] for h in history1]  # metrics are global
    rewards = [h["reward_mean"] for h in history0]
    assert sum(rewards[:3]) / 3 < 0.2 and sum(rewards[-5:]) / 5 > 0.6

    # on_step runs on rank 0 only, with every rank's completions; each prompt's group stays on one rank
    records0, records1 = (json.loads((tmp_path / f"records-rank{r}.json").read_text()) for r in (0, 1))
    assert records1 == [] and len(records0) == 25 * 16 * 16
    first_step = [r for r in records0 if r["step"] == 1]
    assert {r["rank"] for r in first_step} == {0, 1}
    assert all(len({r["rank"] for r in first_step if r["group_index"] == g}) == 1 for g in range(16))

    state = read_trainer_state(tmp_path / "checkpoints" / "step-000025")
    assert len(state["rng"]) == 2  # both ranks' RNG states, written by rank 0
