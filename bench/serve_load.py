"""Load test of the served policy, batching on vs off, optionally with hostile clients in the mix.

    python bench/serve_load.py /tmp/smol --requests 16 --concurrency 8 --k 4 --max-new-tokens 64
    python bench/serve_load.py /tmp/smol --requests 16 --concurrency 4 --slow-clients 16 --disconnects 8

Serves the Bento with ``RLVR_BATCHING=0`` and ``=1`` in turn and sends the same ``/solve`` requests
from ``--concurrency`` threads, optionally beside clients that hang up (``--disconnects``) or stall
their bodies (``--slow-clients``). Reports answered requests, errors, requests/s, completion tokens/s,
p50/p95 latency and batch size; exits 1 when a measured request failed or a request was lost or
mislogged in the traffic log or the metrics.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import ServedBento, build_served_bento, percentile, post, questions  # noqa: E402
from bentos.limits import MAX_COMPLETION_TOKENS, MAX_NEW_TOKENS  # noqa: E402
from rlvr.monitoring.traffic import read_traffic  # noqa: E402


def requests_by_status(metrics_url: str) -> dict[str, float]:
    """``rlvr_requests_total`` summed over endpoints, by status, from the server's /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=30) as resp:
        text = resp.read().decode()
    counts: dict[str, float] = {}
    for status, value in re.findall(r'^rlvr_requests_total\{[^}]*status="(\d+)"[^}]*\} (\S+)$', text, re.M):
        counts[status] = counts.get(status, 0.0) + float(value)
    return counts


def raw_client(port: int, body: bytes, send: int | None = None) -> socket.socket:
    """A connection that sent a ``/solve`` request's headers and the first ``send`` bytes of its body (all by default)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"POST /solve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body[: len(body) if send is None else send])
    return sock


def response_status(sock: socket.socket, timeout_s: float) -> int:
    """The status the server answered on ``sock``; 0 when it closed or said nothing within ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        line = sock.recv(64).split(b"\r\n", 1)[0]
    except OSError:
        return 0
    return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0


def slow_client(port: int, stop: threading.Event, answers: list[int], lock: threading.Lock) -> None:
    """Headers and 5 bytes of body, then silence until the server answers (408 expected); again until ``stop``."""
    body = json.dumps({"question": "slow", "k": 1, "max_new_tokens": 4}).encode()
    while not stop.is_set():
        with raw_client(port, body, send=5) as sock:
            status = response_status(sock, 60)
        with lock:
            answers.append(status)


def disconnecting_client(port: int, body: dict, after_s: float) -> int:
    """Send a long request and hang up after ``after_s``: the status it saw first (0: none, as intended)."""
    with raw_client(port, json.dumps(body).encode()) as sock:
        return response_status(sock, after_s)


def run_load(
    url: str,
    bodies: list[dict],
    concurrency: int,
    timeout_s: float,
    max_total_s: float,
    slow_clients: int = 0,
    disconnects: list[dict] | None = None,
    disconnect_after_s: float = 1.0,
) -> dict:
    """Send ``bodies`` from ``concurrency`` threads; stop sending after ``max_total_s``. Meanwhile
    the ``disconnects`` requests go one after another from the start, each hanging up after
    ``disconnect_after_s``, and ``slow_clients`` slow-body connections stay open until both are done."""
    pending = list(enumerate(bodies))
    lock = threading.Lock()
    results: list[dict] = []
    slow_answers: list[int] = []
    hangups: list[dict] = []
    port = int(url.rsplit(":", 1)[1])
    stop = threading.Event()
    started = time.perf_counter()
    hostile = [threading.Thread(target=slow_client, args=(port, stop, slow_answers, lock)) for _ in range(slow_clients)]

    def hang_up_in_turn() -> None:
        for body in disconnects or []:
            status = disconnecting_client(port, body, disconnect_after_s)
            with lock:
                hangups.append({"prompt": body["question"], "status": status})

    hanging_up = threading.Thread(target=hang_up_in_turn)
    hanging_up.start()
    for t in hostile:
        t.start()

    def client() -> None:
        while True:
            with lock:
                if not pending or time.perf_counter() - started > max_total_s:
                    return
                index, body = pending.pop(0)
            t0 = time.perf_counter()
            status, out = post(url + "/solve", body, timeout_s)
            latency = time.perf_counter() - t0
            with lock:
                results.append(
                    {
                        "index": index,
                        "status": status,
                        "latency_s": latency,
                        "prompt": body["question"],
                        "request_id": out.get("request_id") if isinstance(out, dict) else None,
                        "error": None if status == 200 else out,
                    }
                )

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - started
    hanging_up.join()
    stop.set()
    for t in hostile:
        t.join()
    return {"wall_s": wall_s, "results": results, "not_sent": len(pending), "slow_answers": slow_answers, "hangups": hangups}


def summarize(name: str, load: dict, traffic_dir: Path, seen_by_server: dict[str, float] | None = None, earlier: set[str] = frozenset()) -> dict:
    """The configuration's numbers; ``seen_by_server``: the ``rlvr_requests_total`` counts the load added;
    ``earlier``: request ids of the records written before it (the warm-up's)."""
    ok = [r for r in load["results"] if r["status"] == 200]
    all_records = [r for r in read_traffic(traffic_dir).records if r["request_id"] not in earlier]
    records = {r["request_id"]: r for r in all_records}
    measured = [records[r["request_id"]] for r in ok if r["request_id"] in records]
    tokens = sum(sum(rec["completion_tokens"]) for rec in measured)
    latencies = [r["latency_s"] for r in ok]
    wall = load["wall_s"]
    passes = [rec["batch_requests"] for rec in measured]
    mislogged = [
        f"measured {r['request_id']}: {records.get(r['request_id'], {}).get('status')}" for r in ok if records.get(r["request_id"], {}).get("status") != 200
    ]
    by_prompt = {rec["prompt"]: rec for rec in all_records}
    for hangup in load["hangups"]:
        record = by_prompt.get(hangup["prompt"])
        expected = hangup["status"] or 499  # 499 when it hung up before any answer
        if record is None or record["status"] != expected:
            mislogged.append(f"{hangup['prompt']}: client saw {hangup['status']}, log says {None if record is None else record['status']}")
    accounted = {r["request_id"] for r in load["results"]} | {r["prompt"] for r in load["results"] + load["hangups"]}
    mislogged += [
        f"unaccounted record {rec['request_id']} ({rec['status']})"
        for rec in all_records
        if rec["request_id"] not in accounted and rec["prompt"] not in accounted
    ]
    if seen_by_server is not None:
        statuses = [r["status"] for r in load["results"]] + load["slow_answers"] + [h["status"] or 499 for h in load["hangups"]]
        seen_by_clients = dict(Counter(str(status) for status in statuses))
        seen_by_server = {k: v for k, v in seen_by_server.items() if v}
        if seen_by_clients != seen_by_server:
            mislogged.append(f"rlvr_requests_total {seen_by_server} but clients saw {seen_by_clients}")
    return {
        "config": name,
        "requests_ok": len(ok),
        "errors": len(load["results"]) - len(ok) + load["not_sent"],
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
        "completion_tokens": tokens,
        "completion_tokens_per_s": round(tokens / wall, 1),
        "latency_p50_s": round(percentile(latencies, 50), 2),
        "latency_p95_s": round(percentile(latencies, 95), 2),
        "mean_requests_per_pass": round(statistics.mean(passes), 2) if passes else None,
        "slow_client_answers": {str(s): load["slow_answers"].count(s) for s in sorted(set(load["slow_answers"]))},
        "disconnects": len(load["hangups"]),
        "lost_or_mislogged": len(mislogged),
        "error_samples": [r["error"] for r in load["results"] if r["status"] != 200][:3] + mislogged[:3],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a Hugging Face checkpoint folder (e.g. the base_policy asset)")
    parser.add_argument("--requests", type=int, default=16, help="measured requests per configuration")
    parser.add_argument("--concurrency", type=int, default=8, help="client threads")
    parser.add_argument("--k", type=int, default=4, help="samples per /solve request")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    parser.add_argument("--max-total-s", type=float, default=600.0, help="per configuration: no request sent after it")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    parser.add_argument("--configs", default="off,on", help="batching configurations to run, in order")
    parser.add_argument("--slow-clients", type=int, default=0, help="slow-body connections open during the load")
    parser.add_argument("--disconnects", type=int, default=0, help="long requests whose clients hang up")
    parser.add_argument("--disconnect-after-s", type=float, default=1.0, help="how long those clients wait")
    parser.add_argument("--out", type=Path, help="write the summaries as JSON here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rlvr-serve-bench-"))
    try:
        home = work / "bentoml"
        built = build_served_bento(args.checkpoint, home)
        print(f"built {built.tag} ({built.size_bytes / 1e6:.0f} MB) from {args.checkpoint}", flush=True)
        bodies = [{"question": q, "k": args.k, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens} for q in questions(args.requests)]
        warm_up = [{"question": q, "k": args.k, "max_new_tokens": 2} for q in questions(12)]
        long_tokens = min(MAX_NEW_TOKENS, MAX_COMPLETION_TOKENS // args.k)  # running when its client hangs up
        hang_ups = [
            {"question": f"{q} [hang-up {i}]", "k": args.k, "temperature": 1.0, "max_new_tokens": long_tokens}
            for i, q in enumerate(questions(args.disconnects))
        ]
        summaries = []
        for name in args.configs.split(","):
            traffic = work / f"traffic-{name}"
            log = work / f"serve-{name}.log"
            with ServedBento(built.tag, home, traffic, name == "on", args.threads, log) as server:
                server.wait_ready(300)
                # Twelve short requests, one at a time: the first passes pay any one-time cost.
                run_load(server.url, warm_up, 1, args.timeout_s, args.max_total_s)
                earlier = {r["request_id"] for r in read_traffic(traffic).records}
                before = requests_by_status(server.url + "/metrics")
                load = run_load(server.url, bodies, args.concurrency, args.timeout_s, args.max_total_s, args.slow_clients, hang_ups, args.disconnect_after_s)
                time.sleep(1.0)  # the hung-up requests' records and counts land
                after = requests_by_status(server.url + "/metrics")
                summaries.append(summarize(f"batching {name}", load, traffic, {k: after.get(k, 0) - before.get(k, 0) for k in after}, earlier))
                print(json.dumps(summaries[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    hostile = args.slow_clients or args.disconnects
    print(
        f"\n{args.requests} /solve requests (k={args.k}, T={args.temperature}, "
        f"max_new_tokens={args.max_new_tokens}), {args.concurrency} concurrent clients, "
        f"OMP_NUM_THREADS={args.threads}"
        + (f"; {args.slow_clients} slow-body clients, {args.disconnects} hang-ups after {args.disconnect_after_s:g} s" if hostile else "")
        + "\n"
    )
    columns = [
        "config",
        "requests_ok",
        "errors",
        "wall_s",
        "requests_per_s",
        "completion_tokens_per_s",
        "latency_p50_s",
        "latency_p95_s",
        "mean_requests_per_pass",
    ]
    titles = ["config", "ok", "errors", "wall s", "req/s", "completion tok/s", "p50 s", "p95 s", "requests/pass"]
    if hostile:
        columns += ["slow_client_answers", "disconnects", "lost_or_mislogged"]
        titles += ["slow clients' answers", "hang-ups", "lost or mislogged"]
    print("| " + " | ".join(titles) + " |")
    print("|" + "---|" * len(titles))
    for s in summaries:
        print("| " + " | ".join(str(s[k]) for k in columns) + " |")
    if len(summaries) == 2 and summaries[0]["requests_per_s"] and summaries[0]["completion_tokens_per_s"]:
        off, on = summaries
        print(
            f"\nthroughput {on['config']} / {off['config']}: "
            f"{on['requests_per_s'] / off['requests_per_s']:.2f}x requests/s, "
            f"{on['completion_tokens_per_s'] / off['completion_tokens_per_s']:.2f}x tokens/s"
        )
    if args.out:
        args.out.write_text(json.dumps(summaries, indent=2))
    return 1 if any(s["errors"] or s["lost_or_mislogged"] for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
