"""Checking cells that teach: a verdict for a learner's answer, never a traceback.

A lab's checker is a function decorated with :func:`checker`. It receives the learner's
answer (a function or a class defined in the notebook), compares it with an independent
reference (single-process training, a formula, fsdp_lab's own implementation) and returns
``correct(...)`` or ``mistake(...)``. The decorator does the rest, the same way for every lab:

* an answer that is still the stub (its code raises ``NotImplementedError``, or it returns or
  trips over a ``...`` placeholder) gives "not solved yet" and the exercise's hint, without
  running anything;
* an exception, a failing rank (``LaunchError``) or a hang (``LaunchTimeout``) becomes a
  verdict that names what happened in one or two lines; ``explain`` (optional) turns known
  errors into named mistakes (e.g. "freed the parameter before backward");
* the verdict is returned; a notebook shows it as text (its ``repr``), so the checking cell
  ends with the call.

Verdicts print no timings and no addresses, so nbval can compare them.

    @checker("count_ranks", hint="all-reduce a tensor holding 1 on every rank")
    def check_count_ranks(count_ranks):
        answers = launch(count_ranks, world_size=3, timeout=CHECK_TIMEOUT)
        if answers == [3, 3, 3]:
            return correct("every rank counted 3 ranks")
        if answers == [1, 1, 1]:
            return mistake("no_collective", "every rank returned 1: nothing was summed")
        return mistake("wrong_value", f"expected 3 on every rank, got {answers}")
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import signal
import sys
import threading
import types
from typing import Any, Callable

from fsdp_lab.launch import LaunchError, LaunchTimeout

CORRECT, NOT_SOLVED, WRONG = "correct", "not solved", "wrong"
CHECK_TIMEOUT = 120.0  # seconds a checker's launch may take (a hang is reported after it)

_HEADINGS = {CORRECT: "correct", NOT_SOLVED: "not solved yet", WRONG: "not yet right"}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a checker concluded about one answer.

    ``status``: "correct", "not solved" or "wrong". ``mistake``: a short name of the mistake
    found ("not_averaged", "wrong_shard_bounds", ...; "stub" when not solved, "" when
    correct); tests assert on it. ``message`` says what the answer shows; ``hint`` what to
    try next.
    """

    exercise: str
    status: str
    message: str
    mistake: str = ""
    hint: str = ""

    @property
    def solved(self) -> bool:
        return self.status == CORRECT

    def report(self) -> str:
        """The text a learner reads: a heading line, the message, and the hint if any."""
        lines = [f"[{self.exercise}] {_HEADINGS[self.status]}: {self.message}"]
        if self.hint and self.status != CORRECT:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.report()

    __str__ = __repr__


@dataclasses.dataclass(frozen=True)
class _Outcome:
    status: str
    message: str
    mistake: str = ""
    hint: str = ""


def correct(message: str) -> _Outcome:
    """The answer is right; ``message`` says what the right answer shows."""
    return _Outcome(CORRECT, message)


def mistake(name: str, message: str, hint: str = "") -> _Outcome:
    """The answer is wrong in a way the checker recognises: ``name`` is the mistake's short
    name, ``message`` what the answer did, ``hint`` (default: the exercise's) what to do."""
    return _Outcome(WRONG, message, name, hint)


def wrong_collectives(used: list[str], expected: str, right: str, why: str, hint: str) -> _Outcome | None:
    """None when the collectives an answer issued (``used``: names recorded by a ``Timeline``)
    are exactly ``expected``; otherwise the mistake "no_collective" (nothing went through
    ``fsdp_lab.collectives``) or "not_<expected>", whose message starts with ``right`` (what the
    answer got right), names what it used and says ``why`` the expected collective is the one."""
    names = sorted(set(used))
    if not names:
        return mistake("no_collective", f"{right}, but no collective went through fsdp_lab.collectives, "
                                        "which the check records", hint)
    if names != [expected]:
        return mistake(f"not_{expected}", f"{right}, but it came through {', '.join(names)}: {why}", hint)
    return None


def not_waited(unwaited_by_rank: list[list[str]], hint: str = "") -> _Outcome | None:
    """The mistake "not_waited" when an answer issued an asynchronous collective and did not wait
    on its handle (``unwaited_by_rank``: each rank's ``Timeline.unwaited``, as recorded by
    :func:`answer_timeline` or :func:`collective_calls`), else None. Checked before the values:
    an unwaited result can look like any other mistake, or by luck like the right answer."""
    names = sorted({name for names in unwaited_by_rank for name in names})
    if not names:
        return None
    return mistake("not_waited", f"your code issued {' and '.join(names)} with async_op=True and never "
                                 "waited on the handle it returned: until handle.wait() returns, the "
                                 "output may not hold the result yet",
                   hint or "keep the handle (handle = collectives.all_reduce(t, async_op=True)) and call "
                           "handle.wait() before the result is read")


@contextlib.contextmanager
def answer_timeline():
    """A ``Timeline`` around a learner's answer, for a checker's ranks: an asynchronous collective
    the answer did not wait on is left in ``timeline.unwaited`` for :func:`not_waited`, without
    the Timeline's warning (which would print under the checking cell)."""
    import warnings

    from fsdp_lab.timeline import Timeline

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*were not waited on before its `with` block ended")
        with Timeline() as timeline:
            yield timeline


# torch.distributed's collective functions -> (the name a Timeline gives the collective, the position
# of the argument whose bytes a Timeline counts as its size: the output of an all-gather, the input of
# a reduce-scatter or an all-to-all, the tensor itself otherwise)
_TORCH_COLLECTIVES = {"all_reduce": ("all_reduce", 0), "broadcast": ("broadcast", 0), "reduce": ("reduce", 0),
                      "all_gather_into_tensor": ("all_gather", 0), "all_gather": ("all_gather", 0),
                      "reduce_scatter_tensor": ("reduce_scatter", 1), "reduce_scatter": ("reduce_scatter", 1),
                      "all_to_all_single": ("all_to_all", 1), "all_to_all": ("all_to_all", 1),
                      # the names torch 2.13 gives the first two tensor forms (the old ones warn there)
                      "all_gather_single": ("all_gather", 0), "reduce_scatter_single": ("reduce_scatter", 1),
                      # the object forms and gather (to one rank): the sent object or tensor counts
                      "all_gather_object": ("all_gather", 1), "gather_object": ("gather", 0),
                      "gather": ("gather", 0)}


@dataclasses.dataclass(frozen=True)
class DirectCall:
    """A collective called straight through ``torch.distributed``: its ``name`` and size ``bytes``
    as a Timeline would record them, and ``args`` (``dtype``, ``group_size``) read the same way."""

    name: str
    bytes: int
    args: dict


class _WatchedWork:
    """torch.distributed's work object of an asynchronous call, noting whether the answer waited on
    it (``wait()``, or took its future to wait on)."""

    def __init__(self, work, name: str):
        self._work, self.name, self.waited = work, name, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        self.waited = True
        return self._work.get_future()

    def __getattr__(self, attribute):
        return getattr(self._work, attribute)


class CollectiveCalls(list):
    """:func:`collective_calls`' list, with ``unwaited``: the asynchronous collectives issued inside
    the block, through ``fsdp_lab.collectives`` or ``torch.distributed``, that were not waited on
    there, by name."""

    unwaited: list[str] = []


@contextlib.contextmanager
def collective_calls():
    """Record every collective the block issues, in the yielded list once the block ends: those
    through ``fsdp_lab.collectives`` as a Timeline's comm events, then every call of
    ``torch.distributed``'s collective functions (looked up on the module, as
    ``dist.all_reduce(...)`` does) as :class:`DirectCall` s with the same ``name``, ``bytes`` and
    ``args``; those not waited on in its ``unwaited`` (see :func:`answer_timeline`). Calls made
    from fsdp_lab's own code (gloo's reduce-scatter is an all-to-all) are the Timeline's, so
    nothing is counted twice. Not thread-safe: it swaps the module's attributes for the
    duration of the block."""
    import torch.distributed as dist

    calls = CollectiveCalls()
    direct_async: list[_WatchedWork] = []  # torch.distributed's own async calls, to see whether they were waited on
    originals = {name: getattr(dist, name) for name in _TORCH_COLLECTIVES if hasattr(dist, name)}

    def recording(function_name, function):
        name, position = _TORCH_COLLECTIVES[function_name]
        signature = inspect.signature(function)
        parameter = list(signature.parameters)[position]

        def call(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("fsdp_lab."):
                return function(*args, **kwargs)  # fsdp_lab's own (gloo's reduce-scatter): the Timeline's
            try:
                arguments = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:  # bad arguments: torch's own function says what is wrong
                return function(*args, **kwargs)
            value = arguments.get(parameter)
            tensors = [t for t in (value if isinstance(value, (list, tuple)) else [value])
                       if hasattr(t, "element_size")]
            calls.append(DirectCall(name, sum(t.numel() * t.element_size() for t in tensors), {
                "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else None,
                "group_size": dist.get_world_size(arguments.get("group"))}))
            work = function(*args, **kwargs)
            if not arguments.get("async_op") or work is None:
                return work
            watched = _WatchedWork(work, name)
            direct_async.append(watched)
            return watched
        return call

    for function_name, function in originals.items():
        setattr(dist, function_name, recording(function_name, function))
    try:
        with answer_timeline() as timeline:
            yield calls
    finally:
        for function_name, function in originals.items():
            setattr(dist, function_name, function)
    calls[:0] = timeline.comm_events()
    calls.unwaited = timeline.unwaited + [w.name for w in direct_async if not w.waited]


def checker(exercise: str, hint: str, *, explain: Callable[[BaseException, str], _Outcome | None] | None = None):
    """Decorate ``check(answer, ...) -> correct(...) | mistake(...)`` into a checker that
    returns a :class:`Verdict` and never raises.

    ``exercise``: the name shown in the verdict (usually the function the learner writes).
    ``hint``: what to write, shown when the answer is a stub or wrong without its own hint.
    ``explain(error, text)``: optional; ``text`` is the error's message plus, for a failing
    rank, its traceback; return a ``mistake(...)`` for errors it recognises, else None.
    """

    def wrap(check: Callable[..., _Outcome]) -> Callable[..., Verdict]:
        @functools.wraps(check)
        def run(answer, *args, **kwargs) -> Verdict:
            stub = unfinished_parts(answer)
            if stub:
                one = len(stub) == 1
                return Verdict(exercise, NOT_SOLVED, f"{_join(stub)} still "
                               f"{'raises' if one else 'raise'} NotImplementedError; replace "
                               f"{'that line' if one else 'those lines'} with your code and run "
                               "the cell again", "stub", hint)
            try:
                outcome = check(answer, *args, **kwargs)
            except Exception as error:  # noqa: BLE001 - every failure becomes a verdict
                outcome = _from_error(error, explain)
            if outcome.status == NOT_SOLVED:
                return Verdict(exercise, NOT_SOLVED, outcome.message, "stub", hint)
            return Verdict(exercise, outcome.status, outcome.message, outcome.mistake,
                           outcome.hint or hint)

        run.exercise = exercise
        return run

    return wrap


class AnswerTimedOut(Exception):
    """An answer called in this process ran past :func:`time_limit`'s seconds."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`AnswerTimedOut` inside the block once ``seconds`` (wall time) have passed, so
    an answer whose loop never ends becomes a verdict instead of a cell that never returns. It
    uses SIGALRM, so it limits only where that reaches: POSIX, on the main thread (where a
    notebook cell runs); elsewhere the block runs unlimited. Raises nothing else itself."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise AnswerTimedOut(f"no answer within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def unfinished_parts(answer: Any) -> list[str]:
    """Names of the functions in ``answer`` whose code still raises ``NotImplementedError``.

    ``answer`` is a function (its nested functions and lambdas are looked into) or a class
    (the functions it and its bases define, except bases from fsdp_lab itself, whose
    methods are given). Returns [] for anything else.
    """
    found = []
    if inspect.isclass(answer):
        for klass in answer.__mro__:
            if klass is object or (klass.__module__ or "").startswith("fsdp_lab."):
                continue
            for name, member in vars(klass).items():
                func = inspect.unwrap(member.__func__ if isinstance(member, (staticmethod, classmethod))
                                      else member)
                if isinstance(func, types.FunctionType) and _raises_not_implemented(func.__code__):
                    found.append(f"{klass.__name__}.{name}")
    elif isinstance(answer, (types.FunctionType, functools.partial)):
        func = answer.func if isinstance(answer, functools.partial) else answer
        if isinstance(func, types.FunctionType) and _raises_not_implemented(func.__code__):
            found.append(func.__name__)
    return list(dict.fromkeys(found))


def is_placeholder(value: Any) -> bool:
    """True if ``value`` is the ``...`` placeholder, or a tuple/list holding one."""
    if value is Ellipsis:
        return True
    return isinstance(value, (tuple, list)) and any(v is Ellipsis for v in value)


def placeholder_left(where: str) -> _Outcome:
    """The outcome for an answer that returned a ``...`` placeholder."""
    return _Outcome(NOT_SOLVED, f"{where} still returns the `...` placeholder; "
                                "write the expression in its place")


def _raises_not_implemented(code: types.CodeType) -> bool:
    if "NotImplementedError" in code.co_names:
        return True
    return any(isinstance(c, types.CodeType) and _raises_not_implemented(c) for c in code.co_consts)


def _join(names: list[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _from_error(error: BaseException, explain) -> _Outcome:
    """Turn an exception raised while checking into an outcome (no traceback shown)."""
    if isinstance(error, LaunchTimeout):
        ranks = "; ".join(f"rank {r}: {last}" for r, last in enumerate(error.last_collectives))
        return mistake("hang", "the ranks did not finish: they waited in different collectives "
                               f"(last entered: {ranks})",
                       "every rank must call the same collectives, in the same order, with the "
                       "same sizes")
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, LaunchError):
        text = f"{error}\n{error.traceback}"
    summary = error_line(error)
    if explain is not None:  # first: a library op may raise NotImplementedError, which is no stub
        known = explain(error, text)
        if known is not None:
            return known
    if "NotImplementedError" in summary:
        return _Outcome(NOT_SOLVED, "the code still raises NotImplementedError; "
                                    "replace that line with your code")
    if "ellipsis" in summary.lower():
        return _Outcome(NOT_SOLVED, "a `...` placeholder is still in the code "
                                    f"({summary}); write your expression in its place")
    if isinstance(error, LaunchError) and _lost_peer(str(error).strip().split("\n", 1)[0]):
        return mistake("peer_left", "a rank's collective lost its peer: another rank had returned without "
                                    "calling it, so the ranks did not call the same collectives",
                       "every rank must call the same collectives, in the same order, whatever its own data "
                       "holds: decide after the collective, not before it")
    if isinstance(error, LaunchError):
        where = f"rank {error.rank} raised" if error.traceback else "a rank failed:"
    else:
        where = "your code raised"
    return mistake("raised", f"{where} {summary}")


def error_line(error: BaseException) -> str:
    """The exception's one-line summary ("ValueError: ..."); for a failing rank, that of the
    first rank that failed (the others usually fail as a consequence), without "rank N raised"
    (which rank fails first can change from run to run). A gloo transport error, which names
    addresses and ports, reads "<type>: a collective failed: gloo lost its connection to another
    rank", so verdicts stay the same from run to run."""
    first = str(error).strip().splitlines()
    if isinstance(error, LaunchError):
        line = first[0] if first else "a rank failed"
        prefix = f"rank {error.rank} raised "
        line = line[len(prefix):] if line.startswith(prefix) else line
    else:
        line = f"{type(error).__name__}: {first[0]}" if first else type(error).__name__
    if _lost_peer(line):
        kind = line.split(":", 1)[0] if ":" in line else "RuntimeError"
        return f"{kind}: a collective failed: gloo lost its connection to another rank"
    return line


def _lost_peer(line: str) -> bool:
    """Whether ``line`` is gloo's transport error (a peer's connection closed or reset), not one
    of gloo's argument errors ("ProcessGroupGloo::allgather: invalid tensor size"), which say
    what is wrong and stay as they are."""
    return "gloo/transport" in line or "Connection closed" in line or "Connection reset" in line
