"""qa and classification: rows from files and datasets folders, the labelled-line parsers, SQuAD's EM and F1,
labels by index or name, hedges, the answer line that ends a row, and both tasks by name under a chat template."""

from __future__ import annotations

import csv
import json
import string

import pytest

from rlvr.generation.stops import StopChecker
from rlvr.rewards import score
from rlvr.rewards.text import labelled_answer
from rlvr.tasks import CLASSIFICATION, QA, TaskError, get_task, problem_record
from support.tiny_models import CHARS, char_tokenizer, embedded_tokenizer, tiny_llama

QA_ROWS = [
    {"question": "Who wrote Hamlet?", "answers": ["William Shakespeare", "Shakespeare"]},
    {"question": "What is the capital of France?", "answers": "Paris", "split": "train"},
    {
        "question": "Where is the tower?",
        "context": "The Eiffel Tower is in Paris.",
        "answers": {"text": ["Paris", "Paris", "in Paris"], "answer_start": [21, 21, 18]},
    },
    {"question": "when was the eiffel tower built", "answer": ["1889", " 1887 to 1889 "]},
]
QA_REFERENCES = [["William Shakespeare", "Shakespeare"], ["Paris"], ["Paris", "in Paris"], ["1889", "1887 to 1889"]]
REVIEWS = [
    {"text": "A wonderful film.", "label": 1},
    {"text": "Dull and far too long.", "label": 0, "split": "train"},
    {"text": "I loved every minute.", "label": 1, "split": "train"},
]
SENTIMENT = ["negative", "positive"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(autouse=True)
def local_datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))


def test_qa_rows_in_every_answer_shape_become_problems(tmp_path):
    problems = QA.load_problems({"path": write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)})
    assert [p.reference["answers"] for p in problems] == QA_REFERENCES
    assert [(p.problem_id, p.split) for p in problems] == [
        ("qa-test-00000", "test"),
        ("qa-train-00000", "train"),
        ("qa-test-00001", "test"),
        ("qa-test-00002", "test"),
    ]
    assert problems[2].question == "The Eiffel Tower is in Paris.\n\nQuestion: Where is the tower?"  # SQuAD's passage first
    assert problems[0].question == "Who wrote Hamlet?" and problems[0].source == "qa.jsonl"


def test_qa_json_parquet_and_csv_files_hold_the_same_problems(tmp_path):
    import pyarrow
    import pyarrow.parquet as parquet

    flat = [{"question": r["question"], "answers": ref, "split": r.get("split", "test")} for r, ref in zip(QA_ROWS, QA_REFERENCES)]
    expected = [(p.split, p.question.split("\n\nQuestion: ")[-1], p.reference) for p in QA.load_problems({"path": write_jsonl(tmp_path / "qa.jsonl", flat)})]
    (tmp_path / "qa.json").write_text(json.dumps(flat))
    parquet.write_table(pyarrow.Table.from_pylist(flat), tmp_path / "qa.parquet")
    with open(tmp_path / "qa.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["question", "answers", "split"])
        writer.writeheader()
        writer.writerows({**row, "answers": json.dumps(row["answers"])} for row in flat)  # a list as CSV holds it
    for name in ("qa.json", "qa.parquet", "qa.csv"):
        assert [(p.split, p.question, p.reference) for p in QA.load_problems({"path": str(tmp_path / name)})] == expected, name
    limited = QA.load_problems({"path": str(tmp_path / "qa.csv"), "limit": 1})
    assert [p.reference["answers"] for p in limited] == [QA_REFERENCES[0], QA_REFERENCES[1]]


def test_qa_field_overrides_and_a_saved_dataset_with_squad_answers(tmp_path):
    import datasets

    squad = {"id": ["a", "b"], "title": ["t", "t"], "context": ["Ottawa is Canada's capital.", "Rome is old."]}
    squad |= {
        "question": ["Capital of Canada?", "Which city is old?"],
        "answers": [{"text": ["Ottawa"], "answer_start": [0]}, {"text": ["Rome"], "answer_start": [0]}],
    }
    folder = tmp_path / "squad"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(squad), "validation": datasets.Dataset.from_dict(squad)}).save_to_disk(str(folder))
    problems = QA.load_problems({"dataset": str(folder), "limit": 1})  # the default test split is "validation", as SQuAD and NQ-open have
    assert [(p.problem_id, p.reference["answers"]) for p in problems] == [("qa-train-00000", ["Ottawa"]), ("qa-test-00000", ["Ottawa"])]
    assert problems[0].question == "Ottawa is Canada's capital.\n\nQuestion: Capital of Canada?" and problems[0].source == str(folder)
    renamed = [{"q": "2+2?", "gold": ["4", 4.0]}]
    problem = QA.load_problems({"path": write_jsonl(tmp_path / "renamed.jsonl", renamed), "question_field": "q", "answers_field": "gold"})[0]
    assert (problem.question, problem.reference) == ("2+2?", {"answers": ["4", "4.0"]})
    with pytest.raises(TaskError, match=r"cannot load dataset .*split 'test'"):
        QA.load_problems({"dataset": str(folder), "test_split": "test"})


@pytest.mark.parametrize(
    "row, message",
    [
        ({"answers": ["x"]}, r"qa.jsonl line 2: field 'question' is missing or empty"),
        ({"question": "q"}, r"qa.jsonl line 2: field 'answers' is missing or holds no non-empty answer"),
        ({"question": "q", "answers": ["", "  "]}, r"qa.jsonl line 2: field 'answers' is missing or holds no non-empty answer"),
        ({"question": "q", "answers": {"text": []}}, r"qa.jsonl line 2: field 'answers' is missing or holds no non-empty answer"),
        ({"question": "q", "answers": [["nested"]]}, r"qa.jsonl line 2: field 'answers' must hold answers"),
        ({"question": "q", "answers": ["x"], "split": "validation"}, r"qa.jsonl line 2: field 'split' must be 'train' or 'test'"),
    ],
)
def test_a_bad_qa_row_is_named_with_its_file_line_and_field(tmp_path, row, message):
    with pytest.raises(TaskError, match=message):
        QA.load_problems({"path": write_jsonl(tmp_path / "qa.jsonl", [QA_ROWS[0], row])})


def test_bad_options_and_files_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answers": ["a"]}\n{not json\n')
    for options, message in [
        ({}, "exactly one of 'path'"),
        ({"path": path, "shuffle": True}, r"unknown options \['shuffle'\]"),
        ({"path": path, "test_split": "test"}, "apply to 'dataset'"),
        ({"path": path, "limit": 0}, "'limit' must be a positive integer"),
        ({"path": str(tmp_path / "qa.txt")}, "is not a .jsonl, .json, .parquet, .csv file"),
        ({"path": str(tmp_path / "absent.jsonl")}, "no file at"),
        ({"path": str(tmp_path / "broken.jsonl")}, "broken.jsonl line 2: not valid JSON"),
    ]:
        with pytest.raises(TaskError, match=message):
            QA.load_problems(options)


@pytest.mark.parametrize(
    "completion, span",
    [
        ("Answer: Paris", "Paris"),
        ("First guess.\nAnswer: Lyon\nNo, wait.\nAnswer: Paris.\n", "Paris."),  # the last Answer: line
        ("answer: paris", "paris"),
        ("**Answer:** Paris", "Paris"),
        ("The final answer: Rome", "Rome"),
        ("Answer:\nParis", "Paris"),  # an empty Answer: is no answer: the last non-empty line
        ("I think it is Paris\n\n", "I think it is Paris"),
        ("  \n", None),
    ],
)
def test_the_answer_span_is_after_the_last_answer_marker_else_the_last_line(completion, span):
    assert QA.parse(completion) == labelled_answer(completion) == span


def test_well_formed_needs_a_line_opening_with_answer_and_an_answer():
    assert QA.well_formed("Reasoning.\nAnswer: Paris") and QA.well_formed("answer: paris\n")
    assert not QA.well_formed("The final answer: Rome") and not QA.well_formed("Answer:\nParis") and not QA.well_formed("Paris")
    assert score("answer_line", "x\n**Answer:** 4").value == 1.0 and score("answer_line", "4").value == 0.0


# (completion, references, exact match, F1), by SQuAD v1.1's evaluate script by hand
SQUAD_CASES = [
    ("Answer: The Eiffel Tower.", ["Eiffel Tower"], 1.0, 1.0),  # articles and punctuation go
    ("Answer: U.S.A.", ["USA"], 1.0, 1.0),
    ("ANSWER: an apple", ["Apple", "a pear"], 1.0, 1.0),
    ("Answer: Barack Obama", ["Obama", "Barack Hussein Obama"], 0.0, 0.8),  # max F1 over references: 2/3 and 4/5
    ("Answer: paris paris france", ["Paris"], 0.0, 0.5),  # shared tokens counted once each: P=1/3, R=1
    ("Answer: Lyon", ["Paris", "the city of Paris"], 0.0, 0.0),
    ("Answer: Paris\nAnswer: Lyon", ["Paris"], 0.0, 0.0),  # the last answer counts
    ("", ["Paris"], 0.0, 0.0),
]


@pytest.mark.parametrize("completion, answers, em, f1", SQUAD_CASES)
def test_exact_match_and_f1_as_squad_scores_them(completion, answers, em, f1):
    assert score("qa_exact_match", completion, answers=answers).value == em
    assert score("qa_token_f1", completion, answers=answers).value == pytest.approx(f1)


def test_qa_rewards_read_the_problems_table_row_and_refuse_a_bad_reference(tmp_path):
    problem = QA.load_problems({"path": write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)})[0]
    record = problem_record(problem.as_row())
    result = score(QA.correctness, "Let me recall.\nAnswer: shakespeare", **record)
    assert result.value == 1.0 and result.details["answer"] == "shakespeare" and result.details["matched"] == "Shakespeare"
    assert score(QA.partial_credit, "Answer: William Blake", **record).value == pytest.approx(0.5)  # P=R=1/2 against "William Shakespeare"
    assert "needs a reference 'answers'" in score("qa_exact_match", "Answer: x", answers="x").details["error"]


def test_classification_maps_integer_labels_to_the_named_labels(tmp_path):
    problems = CLASSIFICATION.load_problems({"path": write_jsonl(tmp_path / "imdb.jsonl", REVIEWS), "labels": SENTIMENT})
    assert [(p.split, p.reference["label"]) for p in problems] == [("test", "positive"), ("train", "negative"), ("train", "positive")]
    assert problems[0].reference["labels"] == SENTIMENT
    assert problems[0].question == "Text:\nA wonderful film.\n\nLabels: negative, positive"
    by_name = [{"review": "Great.", "sentiment": "Positive"}, {"review": "Bad.", "sentiment": "negative"}, {"review": "Fine.", "sentiment": "neutral"}]
    named = CLASSIFICATION.load_problems({"path": write_jsonl(tmp_path / "named.jsonl", by_name), "text_field": "review", "label_field": "sentiment"})
    assert [p.reference for p in named] == [{"label": label, "labels": ["negative", "neutral", "Positive"]} for label in ("Positive", "negative", "neutral")]


def test_a_saved_dataset_names_its_labels_by_its_class_label_feature(tmp_path):
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    rows = {"text": [r["text"] for r in REVIEWS], "label": [r["label"] for r in REVIEWS]}
    split = datasets.Dataset.from_dict(rows, features=features)
    folder = tmp_path / "imdb"
    datasets.DatasetDict({"train": split, "test": split, "unsupervised": split}).save_to_disk(str(folder))
    problems = CLASSIFICATION.load_problems({"dataset": str(folder), "train_split": None})
    assert [p.reference for p in problems] == [{"label": label, "labels": ["neg", "pos"]} for label in ("pos", "neg", "pos")]
    renamed = CLASSIFICATION.load_problems({"dataset": str(folder), "train_split": None, "labels": SENTIMENT, "limit": 1})
    assert [p.reference["label"] for p in renamed] == ["positive"]  # the option's names win over the dataset's


@pytest.mark.parametrize(
    "rows, options, message",
    [
        ([{"text": "t", "label": 2}], {"labels": SENTIMENT}, r"imdb.jsonl line 1: field 'label' is 2: an integer label indexes the labels"),
        ([{"text": "t", "label": 1}], {}, r"imdb.jsonl line 1: field 'label' is the index 1; name the labels with the option 'labels'"),
        ([{"text": "t", "label": "meh"}], {"labels": SENTIMENT}, r"imdb.jsonl line 1: field 'label' is 'meh', not one of the labels"),
        ([{"text": "", "label": 1}], {"labels": SENTIMENT}, r"imdb.jsonl line 1: field 'text' is missing or empty"),
        ([{"text": "t"}], {"labels": SENTIMENT}, r"imdb.jsonl line 1: field 'label' is missing or empty"),
        ([{"text": "t", "label": "pos"}], {}, r"must name at least two distinct labels"),
        ([{"text": "t", "label": 0}], {"labels": ["Yes", "yes."]}, r"option 'labels' must name at least two distinct labels"),
        ([{"text": "t", "label": 0}], {"labels": "negative,positive"}, r"option 'labels' must be a list of non-empty label strings"),
    ],
)
def test_a_bad_classification_row_or_label_set_is_refused_by_name(tmp_path, rows, options, message):
    with pytest.raises(TaskError, match=message):
        CLASSIFICATION.load_problems({"path": write_jsonl(tmp_path / "imdb.jsonl", rows), **options})


@pytest.mark.parametrize(
    "completion, value",
    [
        ("The acting is superb.\nLabel: positive", 1.0),
        ("label: Positive.", 1.0),
        ("Label: negative\nOn reflection,\nLabel: positive", 1.0),  # the last Label: line
        ("It is a positive review.", 1.0),  # no Label: line: the one label the last line mentions
        ("Label: positive or negative", 0.0),  # a hedge
        ("Positive and negative parts.\nLabel: mixed", 0.0),
        ("Label: negative", 0.0),
        ("", 0.0),
    ],
)
def test_label_match_reads_the_label_line_and_a_hedge_scores_zero(completion, value):
    reference = {"label": "positive", "labels": SENTIMENT}
    assert score(CLASSIFICATION.correctness, completion, **reference).value == value
    assert score("classification", CLASSIFICATION.parse(completion) or "", **reference).value == value  # the same logic on the parser's span
    assert score("label_line", completion).value == float(CLASSIFICATION.well_formed(completion))


def test_a_completed_answer_line_ends_the_row():
    tokenizer = char_tokenizer(CHARS + string.ascii_uppercase)
    checker = StopChecker(tiny_llama(len(tokenizer)), tokenizer)

    def ends_after(task, text: str) -> str | None:
        ids = tokenizer(text).input_ids
        for n in range(1, len(ids) + 1):
            if checker.finish_reason(ids[:n], 200, task.stop_rule) is not None:
                return tokenizer.decode(ids[:n])
        return None

    assert ends_after(QA, "The play is by\nAnswer: Shakespeare\nand more") == "The play is by\nAnswer: Shakespeare\n"
    assert ends_after(QA, "Answer:\nthe final answer: Rome\nmore") is None  # no line opening with an answered Answer:
    assert ends_after(CLASSIFICATION, "Superb.\nLabel: positive\nmore") == "Superb.\nLabel: positive\n"
    assert ends_after(CLASSIFICATION, "Labels: negative, positive\nmore") is None


def test_both_tasks_load_by_name_and_render_prompts_under_the_chat_template(tmp_path):
    tokenizer = embedded_tokenizer()
    qa, classification = get_task("qa"), get_task("classification")
    assert (qa, classification) == (QA, CLASSIFICATION)
    question = qa.load_problems({"path": write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)})[2]
    review = classification.load_problems({"path": write_jsonl(tmp_path / "imdb.jsonl", REVIEWS), "labels": SENTIMENT})[0]
    qa_prompt, review_prompt = qa.render_prompt(tokenizer, question), classification.render_prompt(tokenizer, review)
    assert "'Answer: <answer>'" in qa_prompt and "Question: Where is the tower?" in qa_prompt
    assert "'Label: <label>'" in review_prompt and "A wonderful film.\n\nLabels: negative, positive" in review_prompt
    for prompt in (qa_prompt, review_prompt):
        assert prompt.index("system") < prompt.index("user") < prompt.rindex("assistant")
    assert (qa.correctness, qa.partial_credit, qa.format_reward) == ("qa_exact_match", "qa_token_f1", "answer_line")
    assert (classification.correctness, classification.format_reward) == ("label_match", "label_line")
