"""The doc-limit checker (tools/check_doc_limits.py) flags what is over its limits and passes what is not."""

import importlib.util
import subprocess
from pathlib import Path

spec = importlib.util.spec_from_file_location("check_doc_limits", Path(__file__).resolve().parents[1] / "tools" / "check_doc_limits.py")
check_doc_limits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_doc_limits)


def module_with_docstring(lines: int) -> str:
    body = "\n".join(f"Line {n} of the module docstring." for n in range(1, lines + 1))
    return f'"""{body}\n"""\n\nimport os\n'


def test_an_eleven_line_module_docstring_is_flagged_and_a_ten_line_one_passes(tmp_path):
    for lines, expected in ((11, ["m.py:1 <module> (11 lines > 10)"]), (10, [])):
        path = tmp_path / "m.py"
        path.write_text(module_with_docstring(lines))
        assert check_doc_limits.docstring_offences("m.py", path.read_text()) == expected


def test_method_docstrings_over_eight_lines_and_speculation_are_flagged():
    eight = "\n".join(["        Line."] * 8)
    source = f'class Engine:\n    def step(self):\n        """Step.\n{eight}\n        """\n\n    def ok(self):\n        """It is presumably fast."""\n'
    assert check_doc_limits.docstring_offences("e.py", source) == [
        "e.py:3 Engine.step (9 lines > 8)",
        'e.py:15 Engine.ok (says "presumably")',
    ]


def test_markdown_length_and_width():
    text = "\n".join(["x" * 201] + ["short"] * 160)
    assert check_doc_limits.text_offences("README.md", text, 160, 200) == ["README.md:161 (161 lines > 160)", "README.md:1 (201 characters > 200)"]
    assert check_doc_limits.text_offences("README.md", "\n".join(["y" * 200] * 160), 160, 200) == []


def test_main_fails_on_a_tracked_file_over_the_limit_and_passes_once_it_is_trimmed(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n")
    (tmp_path / "docs" / "benchmarks.md").write_text("# b\n")
    (tmp_path / "m.py").write_text(module_with_docstring(11))
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "m.py"], cwd=tmp_path, check=True)
    assert check_doc_limits.main(tmp_path) == 1
    assert "m.py:1 <module> (11 lines > 10)" in capsys.readouterr().out
    (tmp_path / "m.py").write_text(module_with_docstring(10))
    assert check_doc_limits.main(tmp_path) == 0
    assert "longest module docstring 10 lines (m.py); README 1 lines" in capsys.readouterr().out
