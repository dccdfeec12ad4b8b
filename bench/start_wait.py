"""The start-wait estimate against the measured start wait, on the service's engine in-process.

    OMP_NUM_THREADS=1 python bench/start_wait.py /tmp/smol --duration-s 60 --rate 2

``bentos.serving_engine.ServingEngine`` (the Bento's engine and settings) steps on a thread of its own, as the
service's model thread does; each request is submitted after asking ``start_wait_s()``, as the service's
admission does. Per request: the estimate at submission and the measured start wait (submitted -> first
token), in seconds and steps, and their ratio; then the ratio's distribution, for (a) a mixed load
(Poisson arrivals; serve_mixed.py's prompts, 1 or 4 rows) and (b) small requests beside one max-cost
request (16 x 512 new tokens).
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import bench_model, percentile  # noqa: E402
from bench.serve_mixed import schedule  # noqa: E402
from bentos.serving_engine import ServingEngine  # noqa: E402
from rlvr.generation import EngineRequest  # noqa: E402

MAX_COST = (16, 512)  # /generate's most rows and new tokens


def mixed_load(args, tokenizer) -> list[tuple[float, list[int], int, int]]:
    """(arrival s, prompt ids, rows, max new tokens): serve_mixed.py's seeded arrivals, a third of the short ones with 4 rows."""
    rng = random.Random(args.seed)
    return [(a["at"], a["prompt"], 4 if a["kind"] == "short" and rng.random() < 1 / 3 else 1, a["max_tokens"]) for a in schedule(args, tokenizer)]


def beside_max_cost(args, tokenizer) -> list[tuple[float, list[int], int, int]]:
    """One max-cost request, then a small one (1 row, 32 new tokens) every ``1 / rate`` s while it runs."""
    arrivals = mixed_load(args, tokenizer)
    prompt = next(p for _, p, _, _ in arrivals)
    small = [(0.5 + i / args.rate, p, 1, 32) for i, (_, p, _, _) in enumerate(a for a in arrivals if len(a[1]) < 400)]
    return [(0.0, prompt, *MAX_COST)] + [s for s in small if s[0] < args.duration_s]


def run(serving: ServingEngine, arrivals) -> list[dict]:
    """Every arrival at its time (the engine stepping on its thread): the estimate at submission and the start wait measured."""
    engine, records, started = serving.engine, [], time.monotonic()
    for at, prompt, rows, new_tokens in arrivals:
        time.sleep(max(0.0, at - (time.monotonic() - started)))
        record = {
            "rows": rows,
            "new_tokens": new_tokens,
            "estimate_s": serving.start_wait_s(len(prompt)),
            "estimate_steps": engine.start_wait_steps(len(prompt)),
        }
        request = EngineRequest(prompt, num_samples=rows, temperatures=(1.0,), max_new_tokens=new_tokens, seed=len(records))
        request.on_tokens = lambda pairs, record=record: record.setdefault("first_step", engine.steps)
        record["submitted_step"], record["future"] = engine.steps, serving.submit(request)
        record["request"] = request
        records.append(record)
    for record in records:
        record.pop("future").result()
        request = record.pop("request")
        record["measured_s"] = request.first_token_s - request.submitted_s
        record["measured_steps"] = record.pop("first_step") - record.pop("submitted_step")
    return records


def report(name: str, records: list[dict]) -> None:
    print(f"\n{name}: {len(records)} requests")
    print(f"{'rows x new':>12} {'estimate s':>11} {'measured s':>11} {'est. steps':>11} {'meas. steps':>12} {'ratio':>7}")
    ratios = []
    for r in records:
        ratio = r["estimate_s"] / max(r["measured_s"], 1e-9)
        ratios.append(ratio)
        shape = f"{r['rows']} x {r['new_tokens']}"
        print(f"{shape:>12} {r['estimate_s']:11.2f} {r['measured_s']:11.2f} {r['estimate_steps']:11.1f} {r['measured_steps']:12d} {ratio:7.2f}")
    within = sum(1 / 1.5 <= x <= 1.5 for x in ratios) / len(ratios)
    qs = ", ".join(f"p{q}={percentile(ratios, q):.2f}" for q in (10, 50, 90))
    print(f"ratio estimate / measured: {qs}, max={max(ratios):.2f}; within 1.5x: {within:.0%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--loads", default="mixed,max-cost")
    parser.add_argument("--duration-s", type=float, default=60.0, help="arrivals stop after this")
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--long-prompt-tokens", type=int, default=1000)
    parser.add_argument("--long-new-tokens", type=int, default=256)
    parser.add_argument("--short-new-tokens", type=int, default=64)
    parser.add_argument("--kv-budget-mib", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = bench_model(str(args.checkpoint), "cpu", None, from_config=False)
    loads = {"mixed": mixed_load, "max-cost": beside_max_cost}
    for name in args.loads.split(","):
        serving = ServingEngine(model.requires_grad_(False), tokenizer, args.kv_budget_mib * 2**20, seed=0)
        chat = mixed_load(args, tokenizer)[0][1]  # as the service warms up: a chat prompt, greedy, 4 tokens
        serving.warm_up(lambda chat=chat: EngineRequest(chat, num_samples=1, temperatures=(0.0,), max_new_tokens=4))
        stop = threading.Event()
        thread = threading.Thread(target=serving.engine.run, args=(stop,), daemon=True)
        thread.start()
        report(name, run(serving, loads[name](args, tokenizer)))
        engine = serving.engine
        print(
            f"measured: {1000 * engine.step_seconds:.0f} ms a step, {1000 * engine.decode_step_seconds:.0f} ms without prompt tokens, "
            f"{1000 * engine.prompt_token_seconds:.1f} ms a prompt token"
        )
        stop.set()
        thread.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
