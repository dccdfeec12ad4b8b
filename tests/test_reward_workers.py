"""Rewards run in worker processes that are killed at the timeout: a verifier that holds the GIL,
crashes, eats memory or starts processes costs one timeout and a 0 reward, never its caller."""

from __future__ import annotations

import threading
import time

import torch

from rlvr.generation import SamplingConfig
from rlvr.grpo import GRPOConfig, GRPOTrainer
from rlvr.rewards import RewardPool, register_reward
from rlvr.tasks.gsm8k import REWARDS as GSM8K_REWARDS
from support.reward_cases import GSM8K, unique_name
from support.tiny_models import COPY_DIGIT_CHARS, COPY_DIGIT_PROBLEMS, char_tokenizer, tiny_llama
from support.waiting import wait_for


class Heartbeat:
    """Counts 10 ms ticks on a thread of the caller's process while a batch is scored."""

    def __enter__(self):
        self.ticks, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()
        return self

    def _beat(self):
        while not self._stop.wait(0.01):
            self.ticks += 1

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_a_verifier_holding_the_gil_is_killed_at_the_timeout_and_its_worker_replaced():
    name = unique_name("gil_hog")

    @register_reward(name)
    def gil_hog(completion, **_):
        """A C-level big-integer power: holds the GIL for minutes, so no thread of its process runs."""
        if completion == "hang":
            pow(9, 9**9)
        return 1.0

    with RewardPool(workers=2, timeout_s=1.0) as pool:
        pool.score_batch({name: 1.0}, ["warm"] * 2, [{}] * 2)  # workers started, the reward loaded
        started = time.monotonic()
        with Heartbeat() as beat:
            batch = pool.score_batch({name: 1.0}, ["ok", "hang", "ok", "hang"], [{}] * 4)
        elapsed = time.monotonic() - started
        assert [row[name].value for row in batch] == [1.0, 0.0, 1.0, 0.0]
        assert "timed out after 1 s" in batch[1][name].details["error"] and "killed" in batch[1][name].details["error"]
        assert pool.killed == 2
        assert elapsed < 4  # two hangs on two workers: one timeout each, in parallel
        assert beat.ticks > 50 * elapsed  # the caller's threads ran all along (GIL never held here)
        again = pool.score_batch({name: 1.0}, ["ok"] * 3, [{}] * 3)  # replaced workers serve the next batch
        assert [row[name].value for row in again] == [1.0] * 3


def test_an_explosive_latex_answer_costs_at_most_one_timeout():
    """`#### 9^{9^{9}}` (policy-written) or as the reference: math_answer never hangs its caller."""
    with RewardPool(workers=2, timeout_s=2.0) as pool:
        started = time.monotonic()
        batch = pool.score_batch(
            GSM8K_REWARDS, ["#### 9^{9^{9}}", "#### 72", "#### 72"], [GSM8K, GSM8K, {**GSM8K, "answer_text": "9^{9^{9}}", "answer_value": None}]
        )
        assert time.monotonic() - started < 8
    assert batch[0]["math_answer"].value == 0.0
    assert batch[1]["math_answer"].value == 1.0
    assert batch[2]["math_answer"].value == 0.0


def test_a_crashing_or_memory_hungry_reward_scores_zero_and_the_pool_goes_on():
    crash, hungry = unique_name("crash"), unique_name("hungry")

    @register_reward(crash)
    def exits_hard(completion, **_):
        import os

        if completion == "crash":
            os._exit(3)  # as a segfault would: no exception, the process is gone
        return 1.0

    @register_reward(hungry)
    def allocates(completion, **_):
        if completion == "big":
            return float(len(bytearray(8 * 2**30)) > 0)  # over the worker's address-space limit
        return 1.0

    with RewardPool(workers=1, timeout_s=20, memory_limit_bytes=2**30) as pool:
        batch = pool.score_batch({crash: 1.0, hungry: 1.0}, ["crash", "big", "fine"], [{}] * 3)
    assert batch[0][crash].value == 0.0 and "crashed its worker process" in batch[0][crash].details["error"]
    assert "exit code 3" in batch[0][crash].details["error"]
    assert batch[1][hungry].value == 0.0 and "MemoryError" in batch[1][hungry].details["error"]
    assert batch[1][crash].value == 1.0 and batch[2][crash].value == 1.0 and batch[2][hungry].value == 1.0


def test_processes_a_reward_started_die_with_its_worker(tmp_path):
    name, pid_file = unique_name("spawner"), tmp_path / "pid"

    @register_reward(name)
    def starts_a_sleeper(completion, pid_file="", **_):
        import subprocess
        import time as clock

        child = subprocess.Popen(["sleep", "300"])
        open(pid_file, "w").write(str(child.pid))
        clock.sleep(300)
        return 1.0

    with RewardPool(workers=1, timeout_s=1.0) as pool:
        batch = pool.score_batch({name: 1.0}, ["x"], [{"pid_file": str(pid_file)}])
    assert batch[0][name].value == 0.0
    pid = int(pid_file.read_text())
    wait_for(lambda: not _alive(pid), 5, f"the reward's child {pid} to die with its worker")


def test_threads_share_one_pool():
    results = []
    with RewardPool(workers=2, timeout_s=20) as pool:
        threads = [
            threading.Thread(target=lambda k=k: results.append(pool.score_batch({"math_answer": 1.0}, [f"#### {k}"] * 5, [{"answer_value": float(k)}] * 5)))
            for k in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(results) == 4 and all(row["math_answer"].value == 1.0 for batch in results for row in batch)


def test_a_training_step_with_a_hanging_reward_finishes_within_the_timeout():
    name = unique_name("hangs_on_copy_3")

    @register_reward(name)
    def hangs_on_one_problem(completion, problem_id=None, **_):
        if problem_id == "copy-3":
            pow(9, 9**9)
        return float(completion[:1].isdigit())

    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    config = GRPOConfig(group_size=4, prompts_per_step=2, total_steps=1, micro_batch_size=8, sampling=SamplingConfig(max_new_tokens=2, temperatures=[1.0]))
    problems = [COPY_DIGIT_PROBLEMS[3], COPY_DIGIT_PROBLEMS[5]]
    torch.manual_seed(0)
    with RewardPool(workers=2, timeout_s=1.0) as pool:
        trainer = GRPOTrainer(tiny_llama(len(tokenizer)), tokenizer, config, pool.reward_fn({name: 1.0}))
        pool.score_batch({name: 1.0}, ["0"] * 2, [{}] * 2)  # workers started, the reward loaded
        metrics, records = trainer.step(problems)
    assert metrics["reward_time_s"] < 30  # 4 hanging jobs on 2 workers: two rounds of a 1 s timeout (the hang itself runs for hours)
    assert [r["reward"] for r in records if r["problem_id"] == "copy-3"] == [0.0] * 4


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
