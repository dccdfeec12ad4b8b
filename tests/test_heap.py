"""keep_freed_memory: a large tensor freed and allocated again reuses its pages instead of faulting them in."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Page faults of allocating and filling a 64 MiB tensor, freed after each round: 40 rounds with
# glibc's defaults, then 40 after keep_freed_memory(). Run in a child process: the setting is
# process-wide and lasting. glibc's heap takes a few rounds to settle, hence the last 10 only.
_PROBE = """
import resource, torch
from rlvr.fastpaths.heap import keep_freed_memory

def faults_of_one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(16 * 1024 * 1024).fill_(1.0)  # 64 MiB, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = [faults_of_one_round() for _ in range(40)][-10:]
took = keep_freed_memory()
kept = [faults_of_one_round() for _ in range(40)][-10:]
print(took, min(default), max(kept))
"""


def test_freed_memory_is_reused_instead_of_faulted_in_again():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout.split()
    took, default_faults, kept_faults = out[0] == "True", int(out[1]), int(out[2])
    pages = 64 * 1024 * 1024 // 4096
    assert took
    assert default_faults >= pages // 2, "glibc's default should map a 64 MiB block afresh each time"
    assert kept_faults < pages // 20, f"{kept_faults} page faults after keep_freed_memory()"


@pytest.mark.parametrize("keep", [True, False])
def test_trainer_keeps_freed_memory_on_cpu_unless_configured_not_to(monkeypatch, keep):
    import rlvr.grpo.trainer as trainer_module
    from rlvr.fastpaths import FastPaths
    from rlvr.grpo import GRPOConfig, GRPOTrainer
    from support.tiny_models import char_tokenizer, copy_digit_reward, tiny_llama

    calls = []
    monkeypatch.setattr(trainer_module, "keep_freed_memory", lambda: calls.append(1) or True)
    tokenizer = char_tokenizer()
    config = GRPOConfig(group_size=2, prompts_per_step=1, fast_paths=FastPaths(keep_freed_memory=keep))
    GRPOTrainer(tiny_llama(len(tokenizer)), tokenizer, config, copy_digit_reward)
    assert len(calls) == int(keep)
