"""lm-evaluation-harness' gsm8k against our own evaluation protocol, on the same served policy and problems.

    python bench/lm_eval_gsm8k.py /tmp/smol --limit 100

Builds and serves the Bento on loopback, then asks it the first ``--limit`` GSM8k test problems twice:
the harness's gsm8k task (5-shot, via ``/v1/completions``; ``bench/lm_eval/gsm8k_local.yaml``, offline)
and our ``/solve`` with ``k = 1`` (zero-shot chat prompt, graded by ``rlvr.answers``). Prints both
accuracies and every problem whose verdict differs, with why (different text or different extraction),
and checks ``rlvr.answers.lm_eval_gsm8k_answers`` against the harness on every response.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import ServedBento, build_served_bento, post  # noqa: E402
from rlvr.answers import lm_eval_gsm8k_answers  # noqa: E402
from rlvr.settings import Settings  # noqa: E402
from rlvr.tasks.gsm8k.dataset import make_problem  # noqa: E402

TASK = "gsm8k_local"
TASK_YAML = ROOT / "bench" / "lm_eval" / f"{TASK}.yaml"
MAX_NEW_TOKENS = 256  # both protocols: lm-eval's max_gen_toks default and our evaluation's


def task_folder(gsm8k_dir: Path, scratch: Path) -> Path:
    """A folder holding the task YAML with its data files at ``gsm8k_dir`` (absolute paths, so any cwd works)."""
    text = TASK_YAML.read_text()
    for split in ("train", "test"):
        text = text.replace(f"rlvr/data/gsm8k/{split}.jsonl", str(gsm8k_dir.resolve() / f"{split}.jsonl"))
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / TASK_YAML.name).write_text(text)
    return scratch


def run_harness(
    url: str,
    model: str,
    tokenizer_dir: Path,
    limit: int,
    *,
    max_gen_toks: int = MAX_NEW_TOKENS,
    concurrency: int = 4,
    gsm8k_dir: Path = Settings.from_env().gsm8k_dir,
    output_dir: Path,
) -> list[dict]:
    """lm-eval's gsm8k on the first ``limit`` test problems through ``url``/v1/completions: per problem,
    its doc, prompt, stop strings, response, and each filter's answer and verdict."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(task_folder(gsm8k_dir, output_dir / "tasks")), include_defaults=False)
    out = simple_evaluate(
        model="local-completions",
        model_args={
            "model": model,
            "base_url": f"{url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tokenizer_dir),
            "tokenized_requests": False,
            "num_concurrent": concurrency,
            "max_gen_toks": max_gen_toks,
            "timeout": 600,
            "max_retries": 1,
        },
        tasks=[TASK],
        task_manager=tasks,
        limit=limit,
        log_samples=True,
    )
    by_doc: dict[int, dict] = {}
    for sample in out["samples"][TASK]:
        prompt, gen_kwargs = sample["arguments"][0]
        (response,) = sample["resps"][0]
        row = by_doc.setdefault(
            sample["doc_id"], {"doc_id": sample["doc_id"], "doc": sample["doc"], "prompt": prompt, "until": gen_kwargs["until"], "response": response}
        )
        name = "strict" if sample["filter"] == "strict-match" else "flexible"
        row[name], row[f"{name}_correct"] = sample["filtered_resps"][0], bool(sample["exact_match"])
    return [by_doc[i] for i in sorted(by_doc)]


def harness_answers(row: dict) -> tuple[str, str]:
    """(strict-match, flexible-extract) as the harness extracted them from one response."""
    return row["strict"], row["flexible"]


def run_ours(url: str, docs: list[dict], concurrency: int) -> list[dict]:
    """Our protocol on the same problems: ``/solve`` k = 1 (greedy), graded by rlvr.evaluation.runner."""
    from rlvr.evaluation.runner import grade_completion, grade_lm_eval

    def solve(doc: dict) -> dict:
        problem = make_problem(doc["question"], doc["answer"], "test", 0, "local", "bench")
        status, out = post(f"{url}/solve", {"question": doc["question"], "k": 1, "max_new_tokens": MAX_NEW_TOKENS}, 600)
        if status != 200:
            raise RuntimeError(f"/solve answered {status}: {out}")
        text = out["reasoning"]
        return {
            "text": text,
            "gold": problem.answer_text,
            "gold_value": problem.answer_value,
            **grade_completion(text, problem.answer_value),
            **grade_lm_eval(text, doc["answer"]),
        }

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(solve, docs))


def compare(harness: list[dict], ours: list[dict]) -> dict:
    """The 2 x 2 of texts (the harness's, ours) by graders (the harness's, ours), and every disagreement."""
    from rlvr.evaluation.runner import grade_completion

    cross = [grade_completion(h["response"], o["gold_value"]) for h, o in zip(harness, ours)]
    n = len(harness)

    def share(values) -> str:
        values = list(values)
        return f"{sum(values) / n:.3f} ({sum(values)}/{n})"

    table = {
        "harness text, harness grading": {m: share(h[f"{m}_correct"] for h in harness) for m in ("strict", "flexible")},
        "harness text, our grading": {m: share(c[f"correct_{m}"] for c in cross) for m in ("strict", "flexible")},
        "our text, harness grading": {m: share(o[f"correct_lm_eval_{m}"] for o in ours) for m in ("strict", "flexible")},
        "our text, our grading": {m: share(o[f"correct_{m}"] for o in ours) for m in ("strict", "flexible")},
    }
    disagreements = []
    for h, o, c in zip(harness, ours, cross):
        for m in ("strict", "flexible"):
            if h[f"{m}_correct"] == o[f"correct_{m}"]:
                continue
            extraction = c[f"correct_{m}"] != h[f"{m}_correct"]  # one text, two graders, two verdicts
            disagreements.append(
                {
                    "doc_id": h["doc_id"],
                    "metric": m,
                    "gold": o["gold"],
                    "harness": "correct" if h[f"{m}_correct"] else "wrong",
                    "ours": "correct" if o[f"correct_{m}"] else "wrong",
                    "reason": "different extraction" if extraction else "different text",
                    "harness_answer": h[m],
                    "our_answer_on_harness_text": c[f"extracted_{m}"],
                    "our_answer": o[f"extracted_{m}"],
                    "harness_text": h["response"],
                    "our_text": o["text"],
                }
            )
    mismatched = [h["doc_id"] for h in harness if lm_eval_gsm8k_answers(h["response"]) != harness_answers(h)]
    return {"problems": n, "table": table, "disagreements": disagreements, "reimplementation_mismatches": mismatched}


def report(result: dict, timings: dict) -> str:
    lines = [f"GSM8k test, first {result['problems']} problems, greedy; {timings}", "", "| text (prompt) | grading | strict | flexible |", "|---|---|---|---|"]
    prompts = {
        "harness": "lm-eval gsm8k: 5-shot `Question: ... Answer:`, raw, /v1/completions",
        "our": "ours: zero-shot training prompt in the chat template, /solve k=1",
    }
    for name, row in result["table"].items():
        text, grading = name.split(", ")
        lines.append(f"| {prompts[text.split()[0]]} | {grading.replace(' grading', '')} | {row['strict']} | {row['flexible']} |")
    lines += [
        "",
        "Harness vs ours (diagonal): harness text + harness grading against our text + our grading.",
        f"rlvr.answers.lm_eval_gsm8k_answers against the harness's own extraction: "
        f"{result['problems'] - len(result['reimplementation_mismatches'])}/{result['problems']} responses agree"
        + (f" (differ: {result['reimplementation_mismatches']})" if result["reimplementation_mismatches"] else ""),
        "",
        f"Disagreements ({len(result['disagreements'])}):",
    ]
    for d in result["disagreements"]:
        lines.append(
            f"- doc {d['doc_id']} {d['metric']}: harness {d['harness']} (answer {d['harness_answer']!r}), "
            f"ours {d['ours']} (answer {d['our_answer']!r}), gold {d['gold']}: {d['reason']} "
            f"(our rules on the harness text: {d['our_answer_on_harness_text']!r})"
        )
        lines.append(f"    harness text ...{json.dumps(d['harness_text'][-160:], ensure_ascii=False)}")
        lines.append(f"    our text     ...{json.dumps(d['our_text'][-160:], ensure_ascii=False)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a Hugging Face checkpoint folder (its tokenizer too)")
    parser.add_argument("--limit", type=int, default=100, help="the first N GSM8k test problems")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight, each protocol")
    parser.add_argument("--gsm8k-dir", type=Path, default=Settings.from_env().gsm8k_dir)
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    parser.add_argument("--output", type=Path, help="write the per-problem results here (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lm-eval-gsm8k-") as scratch:
        scratch = Path(scratch)
        bento = build_served_bento(args.checkpoint, scratch / "bentoml")
        with ServedBento(bento.tag, scratch / "bentoml", scratch / "traffic", batching=True, threads=args.threads, log_path=scratch / "serve.log") as served:
            served.wait_ready(600)
            with urllib.request.urlopen(f"{served.url}/v1/models", timeout=30) as resp:
                model = json.loads(resp.read())["data"][0]["id"]
            started = time.perf_counter()
            harness = run_harness(served.url, model, args.checkpoint, args.limit, concurrency=args.concurrency, gsm8k_dir=args.gsm8k_dir, output_dir=scratch)
            harness_s = time.perf_counter() - started
            started = time.perf_counter()
            ours = run_ours(served.url, [h["doc"] for h in harness], args.concurrency)
            ours_s = time.perf_counter() - started
    result = compare(harness, ours)
    print(report(result, {"harness_s": round(harness_s, 1), "ours_s": round(ours_s, 1)}))
    if args.output:
        args.output.write_text(json.dumps({**result, "harness": harness, "ours": ours}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
