import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

import rlvr
from rlvr.settings import Settings
from rlvr.tasks.gsm8k import dataset as gsm8k


def write_split(folder, split, records):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


RECORD = {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"}


def test_load_local_official_files(gsm8k_dir):
    problems = gsm8k.load_local(gsm8k_dir)
    counts = {s: sum(p.split == s for p in problems) for s in gsm8k.SPLITS}
    assert counts == gsm8k.OFFICIAL_COUNTS
    first = problems[0]
    assert first.problem_id == "local-train-00000"
    assert first.answer_text == "72" and first.answer_value == 72.0 and first.num_steps == 2
    assert all(o.passed for o in gsm8k.validate_problems(problems, gsm8k.OFFICIAL_COUNTS))


# The official release's SHA-256 (github.com/openai/grade-school-math, grade_school_math/data).
OFFICIAL_SHA256 = {
    "train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
}


def test_the_shipped_copy_is_the_default_and_the_official_release(monkeypatch):
    monkeypatch.delenv("RLVR_GSM8K_DIR", raising=False)
    folder = Settings.from_env().gsm8k_dir
    assert folder == Path(rlvr.__file__).resolve().parent / "data" / "gsm8k"
    assert (folder / "LICENSE").read_text().startswith("MIT License")
    assert sorted(gsm8k.verify_checksums(folder)) == ["test.jsonl", "train.jsonl"]
    assert {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in OFFICIAL_SHA256} == OFFICIAL_SHA256
    monkeypatch.setenv("RLVR_GSM8K_DIR", "/somewhere/else")
    assert Settings.from_env().gsm8k_dir == Path("/somewhere/else")


def test_a_changed_file_fails_its_checksum_before_any_row_is_read(tmp_path, gsm8k_dir):
    shutil.copytree(gsm8k_dir, tmp_path / "copy")
    test_file = tmp_path / "copy" / "test.jsonl"
    test_file.write_bytes(test_file.read_bytes().replace(b"#### 18", b"#### 19", 1))  # one answer changed
    with pytest.raises(gsm8k.DataSourceError, match=r"copy/test\.jsonl does not match .*SHA256SUMS: sha256 [0-9a-f]{64}, expected 3730d3"):
        gsm8k.load_local(tmp_path / "copy")
    test_file.unlink()
    with pytest.raises(gsm8k.DataSourceError, match="SHA256SUMS lists test.jsonl, which is not in"):
        gsm8k.load_local(tmp_path / "copy")
    (tmp_path / "copy" / "SHA256SUMS").write_text("not a checksum line\n")
    with pytest.raises(gsm8k.DataSourceError, match="SHA256SUMS line 1: expected '<sha256>  <file name>'"):
        gsm8k.load_local(tmp_path / "copy")


def test_load_local_limit(gsm8k_dir):
    problems = gsm8k.load_local(gsm8k_dir, limit=5)
    assert [p.split for p in problems] == ["train"] * 5 + ["test"] * 5


def test_missing_folder_and_file(tmp_path):
    with pytest.raises(gsm8k.DataSourceError, match="folder not found"):
        gsm8k.load_local(tmp_path / "nope")
    write_split(tmp_path, "train", [RECORD])
    with pytest.raises(gsm8k.DataSourceError, match="has no test.jsonl"):
        gsm8k.load_local(tmp_path)


def test_malformed_line_is_named(tmp_path):
    write_split(tmp_path, "train", [RECORD])
    write_split(tmp_path, "test", [RECORD])
    with open(tmp_path / "test.jsonl", "a") as f:
        f.write('{"question": "broken"\n')
    with pytest.raises(gsm8k.DataSourceError, match=r"test.jsonl line 2: malformed JSON"):
        gsm8k.load_local(tmp_path)


def test_unreadable_file(tmp_path):
    write_split(tmp_path, "train", [RECORD])
    (tmp_path / "test.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(gsm8k.DataSourceError, match="cannot read"):
        gsm8k.load_local(tmp_path)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"question": "", "answer": "#### 1"}, "'question' is missing or empty"),
        ({"question": "q?"}, "'answer' is missing or empty"),
        ({"question": "q?", "answer": "no marker"}, "no '#### <answer>' line"),
        ({"question": "q?", "answer": "#### seven"}, "'seven' is not a number"),
    ],
)
def test_bad_records_are_named(tmp_path, record, message):
    write_split(tmp_path, "train", [RECORD, record])
    write_split(tmp_path, "test", [RECORD])
    with pytest.raises(gsm8k.DataSourceError, match=f"train.jsonl line 2: .*{re.escape(message)}"):
        gsm8k.load_local(tmp_path)


def test_validate_flags_overlap_and_counts(tmp_path):
    write_split(tmp_path, "train", [RECORD])
    write_split(tmp_path, "test", [dict(RECORD, question="  TOM has 3 apples and   buys 4. How many?")])
    outcomes = {o.name: o for o in gsm8k.validate_problems(gsm8k.load_local(tmp_path), {"train": 2, "test": 1})}
    assert not outcomes["no_split_overlap"].passed
    assert not outcomes["row_counts"].passed and "train: 1 rows, expected 2" in outcomes["row_counts"].description
    assert outcomes["answers_parse"].passed and outcomes["no_nulls"].passed


def test_gsm_symbolic_offline_generator():
    problems = gsm8k.generate_reasoning_gym("gsm_symbolic", train_size=30, test_size=10, seed=3)
    assert sum(p.split == "train" for p in problems) == 30
    assert sum(p.split == "test" for p in problems) == 10
    assert {p.source for p in problems} == {"gsm_symbolic"}
    assert all(o.passed for o in gsm8k.validate_problems(problems, {"train": 30, "test": 10}))
    again = gsm8k.generate_reasoning_gym("gsm_symbolic", train_size=30, test_size=10, seed=3)
    assert [p.content_hash for p in again] == [p.content_hash for p in problems]


def test_contamination_guard():
    with pytest.raises(gsm8k.DataSourceError, match="contaminated evaluation"):
        gsm8k.check_no_contamination("gsm_symbolic", "local", "test")
    gsm8k.check_no_contamination("gsm_symbolic", "gsm_symbolic", "test")
    gsm8k.check_no_contamination("local", "local", "test")


def test_hub_errors_are_clear(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(gsm8k.DataSourceError, match="could not load 'openai/gsm8k'"):
        gsm8k.load_hub()


def test_reasoning_gym_task_with_numeric_answers():
    problems = gsm8k.generate_reasoning_gym("chain_sum", train_size=20, test_size=5, seed=1)
    assert {p.source for p in problems} == {"reasoning_gym:chain_sum"}
    assert all(p.solution == "" and p.num_steps == 0 for p in problems)
    assert all(o.passed for o in gsm8k.validate_problems(problems, {"train": 20, "test": 5}))
    with pytest.raises(gsm8k.DataSourceError, match="reasoning-gym task 'no_such_task'"):
        gsm8k.generate_reasoning_gym("no_such_task", 2, 2)
