"""The start-wait estimate against the measured start wait, on the service's engine in-process.

    OMP_NUM_THREADS=1 python bench/start_wait.py /tmp/smol --duration-s 60 --rate 2

``bentos.serving_engine.ServingEngine`` (the Bento's engine and settings) steps on a thread of its own, as the
service's model thread does; each request is submitted after asking ``start_wait_s()``, as the service's
admission does. Per request: the estimate at submission, in parts (``Engine.start_wait``), beside the measured
start wait (submitted -> first token) and the steps it spanned; then the ratio's distribution, for (a) a mixed load
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


def logged_steps(engine) -> list[tuple[int, float, int, int]]:
    """(step, seconds, tokens, prompt tokens) of every step from now on, as the engine measures them."""
    steps, measure = [], engine._measure

    def logged(elapsed: float, tokens: int, prompt_tokens: int, work: float) -> None:
        steps.append((engine.steps, elapsed, tokens, prompt_tokens))
        measure(elapsed, tokens, prompt_tokens, work)

    engine._measure = logged
    return steps


def run(serving: ServingEngine, arrivals) -> list[dict]:
    """Every arrival at its time (the engine stepping on its thread): the estimate at submission, in parts,
    and the start wait measured, with the steps it spanned."""
    engine, records, started = serving.engine, [], time.monotonic()
    steps = logged_steps(engine)
    for at, prompt, rows, new_tokens in arrivals:
        time.sleep(max(0.0, at - (time.monotonic() - started)))
        wait = engine.start_wait(prompt)
        record = {"rows": rows, "new_tokens": new_tokens, "prompt": len(prompt), "estimate_s": serving.start_wait_s(prompt), "parts": wait}
        request = EngineRequest(prompt, num_samples=rows, temperatures=(1.0,), max_new_tokens=new_tokens, seed=len(records))
        request.on_tokens = lambda pairs, record=record: record.setdefault("first_step", engine.steps)
        record["submitted_step"], record["future"] = engine.steps, serving.submit(request)
        record["request"] = request
        records.append(record)
    for record in records:
        record.pop("future").result()
        request = record.pop("request")
        record["measured_s"] = request.first_token_s - request.submitted_s
        first, submitted = record.pop("first_step"), record.pop("submitted_step")
        spanned = [s for s in steps if submitted < s[0] <= first]
        record["measured_steps"] = len(spanned)
        record["measured_prompt_tokens"] = sum(p for _, _, _, p in spanned)
        record["spanned_s"] = sum(e for _, e, _, _ in spanned)
    return records


def report(name: str, records: list[dict]) -> None:
    """Per request: estimate and measured wait, and the estimate's parts beside what the wait spanned."""
    print(f"\n{name}: {len(records)} requests")
    print(
        f"{'rows x new':>10} {'prompt':>6} {'est s':>6} {'meas s':>6} {'ratio':>5} | {'est st':>6} {'meas st':>7} | "
        f"{'est pt':>6} {'meas pt':>7} {'pt ms':>5} {'pst ms':>6} {'dec ms':>6} | {'est steps s':>11} {'meas steps s':>12} {'under':>5}"
    )
    ratios = []
    for r in records:
        ratio = r["estimate_s"] / max(r["measured_s"], 1e-9)
        ratios.append(ratio)
        w, shape = r["parts"], f"{r['rows']} x {r['new_tokens']}"
        print(
            f"{shape:>10} {r['prompt']:6d} {r['estimate_s']:6.2f} {r['measured_s']:6.2f} {ratio:5.2f} | {w.slot_steps + 1:6d} "
            f"{r['measured_steps']:7d} | {w.prompt_tokens + round(w.arriving_tokens):6d} {r['measured_prompt_tokens']:7d} {1000 * w.prompt_token_s:5.2f} "
            f"{1000 * w.prompt_step_s:6.0f} {1000 * w.decode_step_s:6.0f} | "
            f"{w.seconds - w.under_way_s:11.2f} {r['spanned_s']:12.2f} {w.under_way_s:5.2f}"
        )
    within = sum(1 / 1.5 <= x <= 1.5 for x in ratios) / len(ratios)
    margin = sum(1 / 1.5 <= x <= 1.5 or abs(r["estimate_s"] - r["measured_s"]) <= 0.25 for x, r in zip(ratios, records)) / len(ratios)
    qs = ", ".join(f"p{q}={percentile(ratios, q):.2f}" for q in (10, 50, 90))
    print(f"ratio estimate / measured: {qs}, max={max(ratios):.2f}; within 1.5x: {within:.0%}; within 1.5x or 0.25 s: {margin:.0%}")


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
            f"{1000 * engine.prompt_token_seconds:.1f} ms a prompt token, {1000 * engine.prompt_step_seconds:.0f} ms a step with prompt tokens"
        )
        stop.set()
        thread.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
