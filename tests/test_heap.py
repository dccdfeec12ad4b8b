"""keep_freed_memory: a large tensor freed and allocated again reuses its pages instead of faulting them in."""

import os
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


_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_HUGE_PROBE = """
import sys, torch
from rlvr.fastpaths import linear_kernels
from rlvr.fastpaths.heap import huge_pages

def huge_kib(tensor):
    '''AnonHugePages of the mapping holding the tensor's first whole 2 MiB (/proc/self/smaps; advice splits a mapping).'''
    address, inside = -(-tensor.data_ptr() // (2 << 20)) * (2 << 20), False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            begin, end = (int(x, 16) for x in fields[0].split("-"))
            inside = begin <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1])

plain = torch.empty(16 << 20).fill_(1.0)  # 64 MiB each: a mapping of its own
advised = huge_pages(torch.empty(16 << 20)).fill_(1.0)
layer = torch.nn.Linear(1024, 4096, bias=False)  # packed: 16 MiB
packed = huge_kib(linear_kernels.pack([layer]).packed) if linear_kernels.available() else -1  # -1: not built here
print(huge_kib(plain), huge_kib(advised), packed)
"""


@pytest.mark.skipif(not os.path.exists(_THP) or "[never]" in open(_THP).read(), reason="no transparent huge pages here")
def test_huge_pages_back_the_advised_tensors_and_the_packed_weights_only():
    """64 MiB advised lie mostly in 2 MiB pages, packed weights too; in ``madvise`` mode a plain tensor's none."""
    out = subprocess.run([sys.executable, "-c", _HUGE_PROBE], capture_output=True, text=True, check=True).stdout.split()
    plain, advised, packed = (int(x) for x in out)
    assert advised >= 32 * 1024, f"{advised} KiB of 64 MiB in huge pages"
    if packed >= 0:  # the linear kernels built here
        assert packed >= 8 * 1024, f"{packed} KiB of the 16 MiB packed weights in huge pages"
    if "[madvise]" in open(_THP).read():
        assert plain == 0
