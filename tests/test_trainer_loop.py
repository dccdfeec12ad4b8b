"""What the trainers share, on its own: the LR schedule, when checkpoints fall due, a save and resume
that continues to the very weights of a run never stopped, the one atomic file write, and the
parent-death signal that keeps training from outliving its launcher."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlvr import files
from rlvr.files import write_atomically
from rlvr.grpo import checkpoint
from rlvr.grpo.trainer_loop import TrainerLoop, lr_multiplier
from rlvr.sft import SFTConfig
from rlvr.training_run import start_training_process
from support.tiny_models import char_tokenizer, tiny_llama
from support.waiting import wait_for


def schedule(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"warmup_steps": 2, "lr_decay": "cosine", "total_steps": 6, "min_lr_ratio": 0.1} | fields)


def test_the_schedule_warms_up_linearly_then_decays_to_its_floor():
    assert [lr_multiplier(s, schedule()) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_multiplier(3, schedule()) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_multiplier(3, schedule(lr_decay="linear")) == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr_multiplier(6, schedule()) == lr_multiplier(9, schedule(lr_decay="linear")) == pytest.approx(0.1)
    assert lr_multiplier(5, schedule(lr_decay="constant")) == 1.0


def loop(tmp_path: Path | None, seed: int = 0, **config) -> TrainerLoop:
    tokenizer = char_tokenizer()
    fields = {"total_steps": 4, "checkpoint_every": 2, "lr": 1e-2, "warmup_steps": 1, "weight_decay": 0.1} | config
    return TrainerLoop(tiny_llama(len(tokenizer), seed=seed), tokenizer, SFTConfig(**fields), tmp_path)


def train_until(trainer: TrainerLoop, stop: int) -> None:
    """The nanoGPT loop on the skeleton: a noisy loss (so the RNG state matters), one optimizer step per step."""
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    while trainer.step_count < stop:
        loss = trainer.policy(input_ids=ids, labels=ids).loss * (1 + 0.1 * torch.rand(()))
        loss.backward()
        trainer.optimizer_step()
        trainer.scheduler.step()
        trainer.step_count += 1
        trainer.record_step({"step": trainer.step_count, "loss": float(loss.detach()), "lr": trainer.optimizer.param_groups[0]["lr"]})


def test_checkpoints_fall_due_every_n_steps_and_after_the_last(tmp_path):
    due = []
    for every, folder in ((2, tmp_path), (0, tmp_path), (2, None)):
        trainer = loop(folder, total_steps=5, checkpoint_every=every)
        due.append([s for s in range(1, 6) if setattr(trainer, "step_count", s) or trainer.checkpoint_due()])
    assert due == [[2, 4, 5], [5], []]


def test_a_resumed_loop_ends_on_the_weights_of_one_never_stopped(tmp_path):
    torch.manual_seed(0)
    straight = loop(None)
    train_until(straight, 4)
    torch.manual_seed(0)
    stopped = loop(tmp_path / "run")
    train_until(stopped, 3)  # a checkpoint at step 2, then killed in step 3's aftermath
    assert stopped.history[1]["checkpoint"] == str(tmp_path / "run" / "step-000002") and "checkpoint" not in stopped.history[2]
    assert all(p.grad is None for p in stopped.policy.parameters())  # optimizer_step clears them

    resumed = loop(tmp_path / "run", seed=5)  # other initial weights: the checkpoint's must replace them
    assert resumed.resume() and resumed.step_count == 2
    assert resumed.optimizer.param_groups[0]["lr"] == straight.history[1]["lr"] == pytest.approx(1e-2 * lr_multiplier(2, resumed.config))
    train_until(resumed, 4)
    for (name, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert checkpoint.latest_checkpoint(tmp_path / "run").name == "step-000004"
    assert not loop(tmp_path / "empty").resume()


def test_write_atomically_replaces_a_file_whole_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "latest"
    assert write_atomically(target, "step-000002") == target and target.read_text() == "step-000002"
    write_atomically(target, "ünïcode".encode())
    assert target.read_bytes() == "ünïcode".encode() and os.listdir(tmp_path) == ["latest"]
    with pytest.raises(TypeError, match=f"bytes or str, got dict for {target}"):
        write_atomically(target, {"step": 3})

    def interrupted(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", interrupted)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, "step-000004")
    assert target.read_bytes() == "ünïcode".encode() and os.listdir(tmp_path) == ["latest"]  # the old content, whole


ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
ARMED = "import os, signal, sys, time; from rlvr.process_lifetime import die_with_parent; {call}; print('armed', flush=True); time.sleep(60)"
MIDDLE = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
"""  # then it exits, leaving its child running


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_process_dies_with_its_parent(tmp_path):
    """A parent starts a child that asks for SIGTERM on its parent's death, then exits: the child goes too."""
    child = ARMED.format(call="die_with_parent(signal.SIGTERM)")
    middle = subprocess.run([sys.executable, "-c", MIDDLE, child], env=ENV, capture_output=True, text=True, timeout=60)
    pid, armed = middle.stdout.split()
    assert armed == "armed", middle.stderr
    wait_for(lambda: gone(int(pid)), 30, f"the orphaned child {pid} to die with its parent")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
@pytest.mark.parametrize("parent, survives", [("None", True), ("os.getppid()", True), ("os.getppid() + 100000", False)])
def test_a_parent_already_gone_sends_the_signal_at_once(parent, survives):
    """``parent`` other than the actual one: re-parented, its parent died before the request took effect."""
    code = ARMED.format(call=f"die_with_parent(signal.SIGTERM, parent={parent})").replace("time.sleep(60)", "sys.exit(0)")
    child = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert (child.returncode, child.stdout) == ((0, "armed\n") if survives else (-signal.SIGTERM, ""))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
@pytest.mark.parametrize("inherited", ["ignored", "blocked"])
def test_the_parent_death_signal_acts_though_it_was_inherited_ignored_or_blocked(inherited):
    """A process started with SIGTERM ignored (a background launcher's SIGINT, to which Dagster maps
    SIGTERM) or blocked still dies by it once it asks for it on its parent's death."""

    def inherit() -> None:
        if inherited == "ignored":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    code = ARMED.format(call="die_with_parent(signal.SIGTERM, parent=os.getppid() + 100000)").replace("time.sleep(60)", "sys.exit(0)")
    child = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60, preexec_fn=inherit)
    assert (child.returncode, child.stdout) == (-signal.SIGTERM, "")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
@pytest.mark.parametrize("inherited", ["ignored", "blocked"])
def test_a_training_process_can_always_be_stopped(inherited):
    """A launcher's ignored or blocked SIGTERM is inherited across fork and exec; a training process
    (:func:`start_training_process`) restores it, so a stop reaches it; without it, the stop is lost."""

    def inherit() -> None:
        if inherited == "ignored":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def started(preexec) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(60)"], stdout=subprocess.PIPE, preexec_fn=preexec)
        assert process.stdout.readline() == b"up\n"
        process.send_signal(signal.SIGTERM)
        return process

    launcher = os.getpid()  # this process: the training's parent
    training = started(lambda: (inherit(), start_training_process(launcher)))
    plain = started(inherit)
    try:
        assert training.wait(timeout=30) == -signal.SIGTERM
        with pytest.raises(subprocess.TimeoutExpired):
            plain.wait(timeout=1)  # the stop did not reach it
    finally:
        plain.kill()
        plain.wait()
        training.stdout.close()
        plain.stdout.close()
