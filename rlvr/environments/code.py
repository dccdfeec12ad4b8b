"""The python environment: the policy runs programs in the sandbox and reads their output as a tool turn.

The policy writes a fenced ```python program in its turn and ends the turn. The episode runs the
last such block in :func:`rlvr.code_execution.sandbox.run_python` (wall time: the per-call cap or what is left of
the budget, whichever is less) and injects a tool turn holding its stdout (and, on failure, an
``Error: ...`` line), then reopens the assistant turn so the policy goes on. A turn without a
program ends the row. Whatever the program does (loops forever, floods stdout, forks, opens
sockets) costs the row a tool error, never the step; chat control tokens in its output are broken
(``<|im_start|>`` becomes ``<¦im_start¦>``) so a program cannot open a turn of its own.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from rlvr.code_execution.sandbox import SandboxLimits, run_python
from rlvr.environments.base import Injection, ToolBudget, ToolCall

OUTPUT = "{output}"  # where a tool turn's text goes in ``tool_turn``
CHATML_TOOL_TURN = "\n<|im_start|>tool\n{output}<|im_end|>\n<|im_start|>assistant\n"  # after the policy's <|im_end|>
NO_OUTPUT = "(no output)"
TRUNCATED = "\n[truncated]"
INSTRUCTIONS = "To run Python, write a program in a ```python code block and end your turn; what it prints comes back as a tool message, then you continue."
_PROGRAM_RE = re.compile(r"```(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL)
_CONTROL_PIPE_RE = re.compile(r"(?<=<)\||\|(?=>)")  # the pipes of <|...|> markers
_SAMPLE_CONTENT = "\x00rlvr-tool-output\x00"


@dataclass(frozen=True)
class CodeTool:
    """Code execution: a turn ending with a ```python block gets back a tool turn with its output.

    ``tool_turn`` frames the output (``{output}`` marks where it goes) and reopens the assistant
    turn; ``control_tokens`` are the tokenizer's special tokens, broken in the output besides any
    ``<|...|>`` marker; ``timeout_s`` caps one program's wall time.
    """

    name: ClassVar[str] = "python"
    instructions: ClassVar[str] = INSTRUCTIONS
    budget: ToolBudget = field(default_factory=ToolBudget)
    timeout_s: float = 2.0
    tool_turn: str = CHATML_TOOL_TURN
    control_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tool_turn.count(OUTPUT) != 1:
            raise ValueError(f"tool_turn must hold {OUTPUT} once, got {self.tool_turn!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")
        object.__setattr__(self, "control_tokens", tuple(sorted({token for token in self.control_tokens if len(token) > 1})))

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, **options: Any) -> CodeTool:
        """A CodeTool whose tool turn is the tokenizer's chat template's (ChatML when the template has
        no ``tool`` role) and that breaks the tokenizer's special tokens in program output."""
        return cls(tool_turn=tool_turn_of(tokenizer), control_tokens=special_tokens_of(tokenizer), **options)

    def episode(self) -> CodeEpisode:
        return CodeEpisode(self)

    def options(self) -> dict[str, Any]:
        return {**asdict(self.budget), "timeout_s": self.timeout_s, "tool_turn": self.tool_turn, "control_tokens": list(self.control_tokens)}


class CodeEpisode:
    """One row's programs: the policy's turn is collected until it ends, then its last program runs."""

    def __init__(self, tool: CodeTool) -> None:
        self.tool = tool
        self.calls: list[ToolCall] = []
        self._turn: list[str] = []
        self._spent_s = 0.0

    def observe(self, text: str, ended_turn: bool) -> Injection | None:
        self._turn.append(text)
        if not ended_turn:
            return None
        programs = _PROGRAM_RE.findall("".join(self._turn))
        self._turn = []
        budget = self.tool.budget
        if not programs or len(self.calls) >= budget.max_calls or self._spent_s >= budget.max_seconds:
            return None
        call = self._run(programs[-1])
        return Injection(text=self.tool.tool_turn.replace(OUTPUT, call.result), call=call)

    def _run(self, program: str) -> ToolCall:
        wall_s = min(self.tool.timeout_s, self.tool.budget.max_seconds - self._spent_s)
        limits = SandboxLimits(cpu_time_s=wall_s, wall_time_s=wall_s, file_size_mb=1, max_output_chars=max(4 * self.tool.budget.max_result_chars, 4096))
        began = time.perf_counter()
        try:
            run = run_python(program, limits=limits)
            stdout, error = run.stdout, run.failure
        except OSError as err:  # the sandbox could not start (no process, no disk): the call fails, not the step
            stdout, error = "", f"sandbox unavailable: {err}"
        latency_s = time.perf_counter() - began
        self._spent_s += latency_s
        output = neutralize_control_tokens(tool_output(stdout, error, self.tool.budget.max_result_chars), self.tool.control_tokens)
        call = ToolCall(index=len(self.calls), tool=CodeTool.name, call=program, result=output, error=error, latency_s=latency_s)
        self.calls.append(call)
        return call


def tool_output(stdout: str, error: str | None, max_chars: int) -> str:
    """What the tool turn says: stdout (cut to fit, marked ``[truncated]``), then ``Error: why`` on
    failure; ``(no output)`` when a program succeeded silently. At most ``max_chars`` characters."""
    error_line = f"Error: {error}" if error else ""
    room = max(0, max_chars - len(error_line) - (1 if error_line else 0))
    if len(stdout) > room:
        stdout = stdout[: room - len(TRUNCATED)] + TRUNCATED if room > len(TRUNCATED) else stdout[:room]
    if error_line:
        output = f"{stdout.rstrip(chr(10))}\n{error_line}" if stdout.strip() else error_line
    else:
        output = stdout if stdout.strip() else NO_OUTPUT
    return output[:max_chars]


def neutralize_control_tokens(text: str, control_tokens: tuple[str, ...] = ()) -> str:
    """``text`` with no chat control token left in it: the pipes of ``<|...|>`` markers become ``¦``
    (no new pipe appears, so no marker can re-form), and each of ``control_tokens`` gets a space
    after its first character (``</s>`` -> ``< /s>``)."""
    text = _CONTROL_PIPE_RE.sub("¦", text)
    for _ in range(8):
        found = [token for token in control_tokens if token in text]
        if not found:
            return text
        for token in found:
            text = text.replace(token, f"{token[0]} {token[1:]}")
    return "[output withheld: it kept forming control tokens]"


def tool_turn_of(tokenizer: Any) -> str:
    """The text a chat template writes between the policy's end-of-turn token and the reopened
    assistant turn, around a ``tool`` message; ChatML's when the template has no ``tool`` role or
    the shape is not one we can splice after the policy's end token."""
    mark = "\x00rlvr-assistant\x00"
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}]
    try:
        rendered = tokenizer.apply_chat_template([*messages, {"role": "tool", "content": _SAMPLE_CONTENT}], tokenize=False, add_generation_prompt=True)
    except Exception:  # templates refuse unknown roles by raising whatever they like
        return CHATML_TOOL_TURN
    end_of_turn = getattr(tokenizer, "eos_token", None) or ""
    after = rendered[rendered.find(mark) + len(mark) :] if mark in rendered else ""
    if not end_of_turn or not after.startswith(end_of_turn) or after.count(_SAMPLE_CONTENT) != 1:
        return CHATML_TOOL_TURN
    return after[len(end_of_turn) :].replace(_SAMPLE_CONTENT, OUTPUT)


def special_tokens_of(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens (``<|im_start|>``, ``<|im_end|>``, ...), as text."""
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    special.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    return tuple(sorted(special - {""}))
