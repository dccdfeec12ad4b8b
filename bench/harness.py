"""What the benchmark scripts share: a served process (a Bento or another server) started and stopped,
the Bento built from a checkpoint, wall-clock timing, medians and percentiles, random-weight models.

Scripts import it as ``bench.harness``; tests/support/served_bento.py serves its Bento through
``ServedBento`` too.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Callable

REPO = Path(__file__).resolve().parents[1]
FALLBACK_QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
]


def questions(n: int) -> list[str]:
    """The first ``n`` GSM8k test questions (the local source's folder), else a few built-in ones, cycled."""
    from rlvr.settings import Settings

    path = Settings.from_env().gsm8k_dir / "test.jsonl"
    found = [json.loads(line)["question"] for line in path.open()][:n] if path.is_file() else FALLBACK_QUESTIONS
    return [found[i % len(found)] for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (the smallest value with at least q% of the values at or below it)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(len(ordered) * q / 100)) - 1]


def seconds(fn: Callable[[], object], cuda: bool = False) -> float:
    """Wall-clock seconds of one ``fn()``; ``cuda``: the GPU's queued work is finished before and after."""
    if cuda:
        import torch

        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    return 1000 * statistics.median(seconds(fn) for _ in range(repeats))


def decode_step_ms(run: Callable[[int], float], tokens: int, repeats: int) -> float:
    """Milliseconds per decode step, median of ``repeats``: (run(tokens) - run(1)) / (tokens - 1), where
    ``run(new_tokens)`` generates that many tokens per row and returns its seconds (the prefill cancels)."""
    return statistics.median((run(tokens) - run(1)) / (tokens - 1) * 1000 for _ in range(repeats))


def bench_model(path: str, device: str, dtype, from_config: bool):
    """The checkpoint's model and tokenizer in eval mode; ``from_config``: random weights (seed 0) from its config."""
    from rlvr.policy import load_policy, load_tokenizer

    if from_config:
        return random_weights_model(path, dtype).to(device).eval(), load_tokenizer(path)
    model, tokenizer = load_policy(path, device, dtype)
    return model.eval(), tokenizer


def random_weights_model(path: str, dtype, attn_implementation: str | None = None):
    """A causal LM with random weights (seed 0) from the config in folder ``path``: timings depend on shapes only."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(path)
    if attn_implementation:
        config._attn_implementation = attn_implementation
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build_served_bento(checkpoint: Path, home: Path, model_version: str = "bench"):
    """The Bento around ``checkpoint``, stored and built in the BentoML home ``home``."""
    from bentos.build import build_bento, store_policy

    tag = store_policy(checkpoint, {"model_version": model_version}, {"source": str(checkpoint)}, home=home)
    return build_bento(tag, home=home)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout_s: float) -> tuple[int, dict | str]:
    """(status, JSON body or error text) of a JSON POST; status 0 when no answer came (timeout, refused)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()[:300]
    except OSError as err:
        return 0, f"{type(err).__name__}: {err}"


class ServedProcess:
    """A server in its own process group on a free loopback port (``port``, ``url``), ready once ``health``
    answers 200; the group is killed on exit. Subclasses call ``start``."""

    health = "/readyz"
    proc: subprocess.Popen
    log: IO[str]

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, command: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None) -> None:
        self.log_path = Path(log_path)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        return self.log_path.read_text()[-chars:]

    def is_ready(self) -> bool:
        """Whether ``health`` answers 200 now."""
        try:
            with urllib.request.urlopen(self.url + self.health, timeout=5) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Poll ``health`` until it answers 200; fails at once if the process exits, with its log's end."""
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{type(self).__name__} exited with {self.proc.returncode}; {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{type(self).__name__} not ready in {timeout_s} s; {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.log.close()


class ServedBento(ServedProcess):
    """``bentoml serve`` of a Bento, its traffic log in ``traffic_dir``; ``threads``: ``OMP_NUM_THREADS``
    (None: the engine picks its own); ``env`` is applied last."""

    def __init__(
        self,
        tag,
        home: Path,
        traffic_dir: Path,
        batching: bool,
        threads: int | None,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ):
        from bentos.build import bentoml_cli, bentoml_env

        super().__init__()
        full_env = {**bentoml_env(home), "RLVR_TRAFFIC_DIR": str(traffic_dir), "RLVR_BATCHING": "1" if batching else "0"}
        if threads is None:
            full_env.pop("OMP_NUM_THREADS", None)
            full_env.pop("RLVR_THREADS", None)
        else:
            full_env["OMP_NUM_THREADS"] = str(threads)
        command = [bentoml_cli(), "serve", str(tag), "--port", str(self.port), "--host", "127.0.0.1"]
        self.start(command, {**full_env, **(env or {})}, log_path, cwd)
