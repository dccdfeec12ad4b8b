"""One rank of the two-process GRPO run in tests/test_grpo_distributed.py (launched by torchrun, gloo on CPU).

Each rank starts from different random weights (DDP must sync them from rank 0), trains the
copy-digit toy task on its half of each step's prompts, and writes its final weights, its
metrics history and the records it was handed to ``OUT_DIR``.
"""

import json
import sys
from pathlib import Path

import torch

from rlvr.generation import SamplingConfig
from rlvr.grpo import GRPOConfig, GRPOTrainer
from support.tiny_models import COPY_DIGIT_CHARS, COPY_DIGIT_PROBLEMS, char_tokenizer, copy_digit_reward, tiny_llama


def main(out_dir: Path) -> None:
    rank = int(__import__("os").environ["RANK"])
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    config = GRPOConfig(
        group_size=16,
        prompts_per_step=16,
        sampling=SamplingConfig(max_new_tokens=3, temperatures=[1.0]),
        lr=1e-2,
        lr_decay="constant",
        total_steps=25,
        num_minibatches=2,
        micro_batch_size=32,
        checkpoint_every=25,
        seed=0,
    )
    records = []
    trainer = GRPOTrainer(
        tiny_llama(len(tokenizer), seed=rank),
        tokenizer,
        config,
        copy_digit_reward,
        checkpoint_dir=out_dir / "checkpoints",
        on_step=lambda step, metrics, step_records: records.extend(step_records),
    )
    assert trainer.dist.world_size == 2 and trainer.dist.rank == rank
    history = trainer.train(COPY_DIGIT_PROBLEMS)
    torch.save(trainer.policy.state_dict(), out_dir / f"weights-rank{rank}.pt")
    (out_dir / f"history-rank{rank}.json").write_text(json.dumps(history))
    (out_dir / f"records-rank{rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
