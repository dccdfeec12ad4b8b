"""reasoning_gym:<dataset>: rewards equal the dataset's own score_answer; splits are exact and disjoint; bad names fail."""

from __future__ import annotations

import json

import pytest
import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS

from rlvr.rewards import RewardPool, score
from rlvr.rewards.reasoning_gym import decode_entry, encode_entry, extract_tagged_answer, reasoning_gym_correct, reasoning_gym_score, storable_entry
from rlvr.tasks import TaskError, get_task, normalized_text_hash, problem_record
from rlvr.tasks.reasoning_gym_task import reasoning_gym_task


def loaded(dataset: str, **options):
    task = reasoning_gym_task(dataset)
    return task, task.load_problems({"train_size": 4, "test_size": 2, **options})


def original_entry(problem) -> dict:
    """The entry as reasoning-gym generates it, built here independently of the reward's cache."""
    ref = problem.reference
    return reasoning_gym.create_dataset(ref["dataset"], seed=ref["seed"], size=ref["size"], **ref["config"])[ref["index"]]


def candidate_answers(entry: dict) -> list[str]:
    gold = entry["answer"]
    wrong = ["wrong", "", "42"]
    return wrong if gold is None else [gold, f"{gold} and more", gold[: len(gold) // 2], *wrong]


@pytest.mark.parametrize("dataset", ["chain_sum", "caesar_cipher", "word_sorting", "knights_knaves"])
def test_rewards_equal_score_answer_on_gold_partial_and_wrong_answers(dataset):
    _, problems = loaded(dataset)
    scorer = reasoning_gym.create_dataset(dataset)
    seen_partial = False
    for problem in problems:
        entry, record = original_entry(problem), problem_record(problem.as_row())  # the reference as the problems table returns it
        assert entry["question"] == problem.question
        for answer in candidate_answers(entry):
            expected = scorer.score_answer(answer, entry)
            result = reasoning_gym_score(f"Let me think.\n<answer> {answer} </answer>", **record)
            assert result.value == pytest.approx(expected, abs=1e-12), (dataset, answer)
            assert result.details["extracted"] == answer.strip()
            assert reasoning_gym_correct(f"<answer>{answer}</answer>", **record).value == float(expected == 1.0)
            seen_partial |= 0.0 < expected < 1.0
        missing = reasoning_gym_score(f"The answer is {entry['answer']}", **record)
        assert missing.value == 0.0 and "no <answer>" in missing.details["reason"]
    assert seen_partial or dataset == "knights_knaves"  # partial credit really happened


def test_an_entry_reasoning_gym_cannot_store_as_json_is_regenerated_and_checked():
    _, problems = loaded("knights_knaves")  # its metadata holds numpy strings
    assert all("entry" not in p.reference for p in problems)
    record = problem_record(problems[0].as_row())
    gold = f"<answer>{original_entry(problems[0])['answer']}</answer>"
    assert reasoning_gym_score(gold, **record).value == 1.0
    tampered = score("reasoning_gym_score", gold, **{**record, "question_sha256": "0" * 64})
    assert tampered.value == 0.0 and "regenerates another question" in tampered.details["error"]


def test_stored_and_regenerated_entries_score_alike():
    _, problems = loaded("chain_sum")
    for problem in problems:
        assert "entry" in problem.reference
        regenerated = {k: v for k, v in problem.reference.items() if k != "entry"}
        for answer in candidate_answers(original_entry(problem)):
            completion = f"<answer>{answer}</answer>"
            assert reasoning_gym_score(completion, **regenerated).value == reasoning_gym_score(completion, **problem.reference).value


def test_a_dataset_whose_answer_is_none_is_graded_by_its_scorer():
    _, problems = loaded("graph_color")
    for problem in problems:
        entry = original_entry(problem)
        assert entry["answer"] is None
        coloring = entry["metadata"]["possible_answer"]  # a dict with int keys: stored through the tagged codec
        assert decode_entry(problem.reference["entry"])["metadata"]["possible_answer"] == coloring
        valid = json.dumps({str(k): v for k, v in coloring.items()})
        clash = json.dumps({str(k): 1 for k in coloring})
        scorer = reasoning_gym.create_dataset("graph_color")
        for answer in (valid, clash, "no coloring"):
            expected = scorer.score_answer(answer, entry)
            assert reasoning_gym_score(f"<answer>{answer}</answer>", **problem.reference).value == expected
        assert reasoning_gym_correct(f"<answer>{valid}</answer>", **problem.reference).value == 1.0


def test_a_scorer_that_raises_scores_zero_with_the_error():
    _, problems = loaded("boxnet")
    result = score("reasoning_gym_score", "<answer>0</answer>", **problems[0].reference)  # boxnet iterates over the parsed int
    assert result.value == 0.0 and "TypeError" in result.details["error"]


def test_rewards_run_in_reward_pool_workers():
    _, problems = loaded("knights_knaves", train_size=2, test_size=1)
    golds = [f"<answer>{original_entry(p)['answer']}</answer>" for p in problems]
    records = [problem_record(p.as_row()) for p in problems]
    with RewardPool(workers=1, timeout_s=60) as pool:  # another process, so another hash seed than this one
        batch = pool.score_batch({"reasoning_gym_correct": 1.0, "answer_tags": 0.1}, [*golds, "<answer>nobody</answer>"], [*records, records[0]])
    assert [b["reasoning_gym_correct"].value for b in batch] == [1.0, 1.0, 1.0, 0.0]
    assert all(b["answer_tags"].value == 1.0 for b in batch)


def test_the_task_loads_exact_disjoint_splits_with_reasoning_gyms_prompt():
    task = get_task("reasoning_gym:chain_sum")
    narrow = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # few distinct questions: duplicates are drawn
    problems = task.load_problems({"train_size": 60, "test_size": 30, "seed": 7, "config": narrow})
    splits = {s: [p for p in problems if p.split == s] for s in ("train", "test")}
    assert (len(splits["train"]), len(splits["test"])) == (60, 30)
    hashes = {s: {normalized_text_hash(p.question) for p in ps} for s, ps in splits.items()}
    assert len(hashes["train"]) == 60 and len(hashes["test"]) == 30 and not hashes["train"] & hashes["test"]
    assert max(p.reference["index"] for p in splits["train"]) >= 60  # some duplicates were skipped
    assert [p.question for p in task.load_problems({"train_size": 60, "test_size": 30, "seed": 7, "config": narrow})] == [p.question for p in problems]
    assert task.messages(problems[0]) == [{"role": "system", "content": SYSTEM_PROMPTS["default"]}, {"role": "user", "content": problems[0].question.strip()}]
    assert (task.correctness, task.partial_credit, task.format_reward) == ("reasoning_gym_correct", "reasoning_gym_score", "answer_tags")
    with pytest.raises(TaskError, match="only .* distinct train problems"):
        task.load_problems({"train_size": 500, "test_size": 1, "config": {**narrow, "allow_negation": False}})


def test_unknown_datasets_options_and_configs_are_refused():
    with pytest.raises(TaskError, match="did you mean chain_sum"):
        reasoning_gym_task("chain_sums")
    with pytest.raises(TaskError, match="unknown reasoning-gym dataset 'nope'.*e.g. ab, acre"):
        get_task("reasoning_gym:nope")
    task = reasoning_gym_task("chain_sum")
    with pytest.raises(TaskError, match=r"unknown options \['train_rows'\]"):
        task.load_problems({"train_rows": 3})
    with pytest.raises(TaskError, match="cannot create the dataset with config"):
        task.load_problems({"config": {"no_such_argument": 1}})
    with pytest.raises(TaskError, match="not in config"):
        task.load_problems({"config": {"seed": 1}})
    with pytest.raises(TaskError, match="'train_size' must be an integer >= 0"):
        task.load_problems({"train_size": -1})


def test_answer_extraction_and_the_tag_format_reward():
    assert extract_tagged_answer("<answer>1</answer> then <answer> 2 \n</answer>") == "2"
    assert extract_tagged_answer("<answer>a <answer>b</answer>") == "b"
    assert extract_tagged_answer("<answer></answer>") == ""
    assert extract_tagged_answer("<answer>open") is None and extract_tagged_answer("</answer><answer>") is None
    tags = lambda text: score("answer_tags", text).value  # noqa: E731
    assert (tags("x <answer>1</answer>"), tags("<answer>1</answer><answer>2</answer>"), tags("</answer><answer>"), tags("1")) == (1.0, 0.0, 0.0, 0.0)


def test_the_entry_codec_is_exact_or_refuses():
    entry = {"a": (1, [2.5, (True, None)]), "b": {3: "x", (4, 5): frozenset({6})}, "c": {"y", "z"}, "d": {"__tuple__": [1]}}
    encoded = encode_entry(entry)
    decoded = decode_entry(json.loads(json.dumps(encoded)))
    assert decoded == entry and type(decoded["a"]) is tuple and type(decoded["d"]) is dict
    assert storable_entry(entry) == encoded
    np = pytest.importorskip("numpy")
    for unstorable in ({"x": np.int64(1)}, {"x": float("nan")}, {"x": object()}):
        assert storable_entry(unstorable) is None
