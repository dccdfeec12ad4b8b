"""``reasoning_gym:<dataset>``: any of reasoning-gym's procedural datasets, graded by its own ``score_answer``.

Options: ``train_size`` (2000), ``test_size`` (200), ``seed`` (0) and ``config`` (the dataset's own
keyword arguments). The splits come from different seeds and share no question (deduplicated by
``normalized_text_hash``). Prompt: reasoning-gym's default system prompt (the answer inside
``<answer>...</answer>``), then the question. Trained with ``reasoning_gym_correct`` + 0.1
``answer_tags``; ``reasoning_gym_score`` is the partial credit (:mod:`rlvr.rewards.reasoning_gym`
says what a reference holds).
"""

from __future__ import annotations

import difflib
import functools
import json
import numbers

from rlvr.rewards.reasoning_gym import question_digest, storable_entry
from rlvr.tasks.base import Task, TaskError, TaskProblem, normalized_text_hash
from rlvr.tasks.parsers import ANSWER_TAGS

FAMILY = "reasoning_gym"
DEFAULT_OPTIONS = {"train_size": 2000, "test_size": 200, "seed": 0, "config": None}
TEST_SEED_OFFSET = 1_000_003  # the test split's seed is the train seed plus this
OVERSAMPLING = 4  # each split draws from 4 * size + 16 items, so duplicates can be skipped


def reasoning_gym_task(dataset: str) -> Task:
    """The task ``reasoning_gym:<dataset>``; an unknown dataset raises TaskError naming known ones."""
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if dataset not in DATASETS:
        close = difflib.get_close_matches(dataset, list(DATASETS), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise TaskError(f"unknown reasoning-gym dataset {dataset!r}; {hint}it has {len(DATASETS)}, e.g. {', '.join(sorted(DATASETS)[:8])}")
    return Task(
        name=f"{FAMILY}:{dataset}",
        load=functools.partial(reasoning_gym_problems, dataset),
        correctness="reasoning_gym_correct",
        rewards={"reasoning_gym_correct": 1.0, "answer_tags": 0.1},
        system_prompt=SYSTEM_PROMPTS["default"],
        description=f"reasoning-gym's {dataset!r} procedural dataset, graded by its own score_answer",
        partial_credit="reasoning_gym_score",
        format_reward="answer_tags",
        parser=ANSWER_TAGS,
        requires=("reasoning-gym",),
        max_new_tokens=512,
    )


def reasoning_gym_problems(dataset: str, options: dict) -> list[TaskProblem]:
    """``train_size`` + ``test_size`` distinct problems of ``dataset`` (see the module docstring for ``options``)."""
    import reasoning_gym

    name = f"{FAMILY}:{dataset}"
    train_size, test_size, seed, config = _checked_options(name, options)
    problems: list[TaskProblem] = []
    seen: set[str] = set()
    for split, size, split_seed in (("train", train_size, seed), ("test", test_size, seed + TEST_SEED_OFFSET)):
        if size == 0:
            continue
        pool_size = OVERSAMPLING * size + 16
        try:
            generator = reasoning_gym.create_dataset(dataset, seed=split_seed, size=pool_size, **config)
        except Exception as err:  # noqa: BLE001 - a bad config fails in the dataset's own code
            raise TaskError(f"task {name!r}: cannot create the dataset with config {config}: {type(err).__name__}: {err}") from None
        count = 0
        for index in range(pool_size):
            if count == size:
                break
            entry = generator[index]
            key = normalized_text_hash(entry["question"])
            if key in seen:
                continue
            seen.add(key)
            reference = {
                "dataset": dataset,
                "config": config,
                "seed": split_seed,
                "size": pool_size,
                "index": index,
                "question_sha256": question_digest(entry["question"]),
            }
            stored = storable_entry(entry)
            if stored is not None:
                reference["entry"] = stored
            problems.append(TaskProblem(name, f"{name}-{split}-{count:05d}", split, entry["question"], reference, source=name))
            count += 1
        if count < size:
            raise TaskError(f"task {name!r}: only {count} distinct {split} problems among {pool_size} generated, {size} asked")
    return problems


def _checked_options(name: str, options: dict) -> tuple[int, int, int, dict]:
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise TaskError(f"task {name!r}: unknown options {unknown}; known: {sorted(DEFAULT_OPTIONS)}")
    merged = {**DEFAULT_OPTIONS, **options}
    for key in ("train_size", "test_size", "seed"):
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (key != "seed" and value < 0):
            raise TaskError(f"task {name!r}: option {key!r} must be an integer{' >= 0' if key != 'seed' else ''}, got {value!r}")
    config = merged["config"] or {}
    if not isinstance(config, dict):
        raise TaskError(f"task {name!r}: option 'config' must be a dict of the dataset's keyword arguments, got {config!r}")
    if {"seed", "size"} & set(config):
        raise TaskError(f"task {name!r}: set the seed and sizes with the options seed, train_size and test_size, not in config")
    try:
        config = json.loads(json.dumps(config))
    except (TypeError, ValueError) as err:
        raise TaskError(f"task {name!r}: option 'config' must be JSON-able (it is stored with each problem): {err}") from None
    return int(merged["train_size"]), int(merged["test_size"]), int(merged["seed"]), config
