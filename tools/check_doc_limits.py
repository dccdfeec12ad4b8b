"""Fail when the docs outgrow what a newcomer reads in an afternoon (run by `make test`).

Limits, on every *.py file git tracks (or would: new, not ignored): a module docstring at most 10
lines, a class or function docstring at most 8 (lines of text, as `inspect.cleandoc` leaves them),
and no docstring that guesses (the word in SPECULATION: measure it or leave it out). README.md at
most 160 lines of at most 200 characters; docs/benchmarks.md at most 400 lines. Exits 1 listing
each offence as `path:line name (why)`; otherwise prints a one-line summary.
"""

import ast
import subprocess
import sys
from pathlib import Path

MODULE_LINES, DEFINITION_LINES = 10, 8
README_LINES, README_WIDTH, BENCHMARKS_LINES = 160, 200, 400
SPECULATION = "presum" + "ably"  # spelt apart so this file passes its own check
DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstrings(source: str) -> list[tuple[int, str, str, int]]:
    """Every docstring of a module as (line, qualified name, text, limit); the module's is `<module>`."""
    found = []

    def visit(node: ast.AST, name: str, limit: int) -> None:
        text = ast.get_docstring(node) if isinstance(node, (ast.Module, *DEFINITIONS)) else None
        if text is not None:
            found.append((node.body[0].lineno, name, text, limit))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, DEFINITIONS):
                visit(child, child.name if isinstance(node, ast.Module) else f"{name}.{child.name}", DEFINITION_LINES)
            elif not isinstance(child, ast.expr):
                visit(child, name, limit)  # definitions nested in if/try/with blocks

    visit(ast.parse(source), "<module>", MODULE_LINES)
    return found


def docstring_offences(path: str, source: str) -> list[str]:
    """`path:line name (why)` for each docstring of ``source`` over its limit or speculating."""
    offences = []
    for line, name, text, limit in docstrings(source):
        lines = len(text.splitlines())
        if lines > limit:
            offences.append(f"{path}:{line} {name} ({lines} lines > {limit})")
        if SPECULATION in text.lower():
            offences.append(f'{path}:{line} {name} (says "{SPECULATION}")')
    return offences


def text_offences(path: str, text: str, max_lines: int, max_width: int | None = None) -> list[str]:
    """Offences of a Markdown file: more than ``max_lines`` lines, or a line wider than ``max_width``."""
    lines = text.splitlines()
    offences = [f"{path}:{len(lines)} ({len(lines)} lines > {max_lines})"] if len(lines) > max_lines else []
    if max_width is not None:
        offences += [f"{path}:{n} ({len(line)} characters > {max_width})" for n, line in enumerate(lines, 1) if len(line) > max_width]
    return offences


def main(root: Path) -> int:
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"]  # tracked, or new and not ignored
    files = sorted({path for path in subprocess.run(listed, cwd=root, capture_output=True, text=True, check=True).stdout.split() if (root / path).is_file()})
    offences, longest = [], (0, "")
    for path in files:
        source = (root / path).read_text(encoding="utf-8")
        offences += docstring_offences(path, source)
        module = [len(text.splitlines()) for _, name, text, _ in docstrings(source) if name == "<module>"]
        longest = max(longest, (module[0] if module else 0, path))
    readme = (root / "README.md").read_text(encoding="utf-8")
    offences += text_offences("README.md", readme, README_LINES, README_WIDTH)
    offences += text_offences("docs/benchmarks.md", (root / "docs/benchmarks.md").read_text(encoding="utf-8"), BENCHMARKS_LINES)
    if offences:
        print(f"{len(offences)} over the limits (tools/check_doc_limits.py):", *offences, sep="\n")
        return 1
    print(f"doc limits hold: {len(files)} files; longest module docstring {longest[0]} lines ({longest[1]}); README {len(readme.splitlines())} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(__file__).resolve().parents[1]))
