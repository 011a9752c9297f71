"""How a rank function travels to the ranks: the user's code by value, modules by reference.

``fsdp_lab.launch`` runs ``fn`` in fresh processes that never import the caller's main
module (a notebook kernel, ``python -``, a script), so ``fn`` is sent by value with
cloudpickle: its code, and whatever it uses that the ranks could not import by name (globals
and closures defined in the notebook or script). Everything importable (torch, transformers,
fsdp_lab, the user's own modules) travels by reference and is imported on each rank.

cloudpickle picks its module reducer by exact type, so a module object of a subclass of
``types.ModuleType`` falls through to plain pickling and fails: torch turns its config modules
(``torch.distributed.config``, ``torch.compiler.config`` ...) into ``ConfigModuleInstance``
objects, and cloudpickle sends along every loaded submodule whose name a function could spell
(``dist`` plus ``model.config`` spells ``torch.distributed.config``). :func:`dumps` sends
every module, whatever its type, by reference.

When something really cannot be pickled, :func:`dumps` names it (which global, closure
variable or argument, and its type) and says what to do instead.
"""

from __future__ import annotations

import dis
import functools
import importlib
import io
import sys
import types
from typing import Any, Iterator

import cloudpickle

_GLOBAL_OPS = {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"}


class Pickler(cloudpickle.CloudPickler):
    """cloudpickle, with every module imported in this process sent by name. (Public because
    ``torch.save(obj, f, pickle_module=fsdp_lab.pickling)`` subclasses ``Pickler``.)"""

    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """``obj`` as bytes, the user's code by value and imported modules by reference.

    Raises the pickler's own error (TypeError, PicklingError, AttributeError ...) when
    something inside cannot be pickled; :func:`dumps_call` explains such failures.
    """
    buffer = io.BytesIO()
    Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """The object :func:`dumps` turned into ``data`` (imports what travelled by reference)."""
    return cloudpickle.loads(data)


def dumps_call(fn, args: tuple, kwargs: dict) -> bytes:
    """``(fn, args, kwargs)`` as bytes for :func:`loads` on another process.

    Raises:
        TypeError: something in the call cannot be pickled. The message names it (e.g.
            "global 'lock' of train(), a _thread.lock"), and says how to avoid sending it.
    """
    try:
        return dumps((fn, args, kwargs))
    except Exception as exc:  # noqa: BLE001 - any pickling failure becomes one clear error
        found = _first_unpicklable(fn, args, kwargs)
        if found is None:
            what, error = "fn or its arguments", exc
        else:
            label, value, error = found
            what = f"{label} (a {_type_name(value)})"
        raise TypeError(
            f"launch() sends fn and its arguments to every rank by value, but {what} cannot be "
            f"pickled: {error}. Create it inside fn, so that each rank builds its own; or pass "
            "what it is built from (a config, a path, a seed) as an argument; or define it in "
            "an importable module, which ranks import by name instead."
        ) from exc


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _first_unpicklable(fn, args, kwargs) -> tuple[str, Any, Exception] | None:
    """(label, value, error) for the first part of the call that fails to pickle, searching
    into the user's functions (their globals, closure variables, defaults), else None."""
    parts = [("fn", fn)] + [(f"argument {i}", a) for i, a in enumerate(args)]
    parts += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    return _search(parts, seen=set())


def _search(parts, seen: set) -> tuple[str, Any, Exception] | None:
    for label, value in parts:
        if id(value) in seen:
            continue
        seen.add(id(value))
        try:
            dumps(value)
            continue
        except Exception as exc:  # noqa: BLE001
            error = exc
        inner = list(_inner_parts(label, value))
        found = _search(inner, seen) if inner else None
        return found or (label, value, error)
    return None


def _inner_parts(label: str, value: Any) -> Iterator[tuple[str, Any]]:
    """What pickling ``value`` by value also pickles, labelled for a user to find it."""
    if isinstance(value, functools.partial):
        yield f"the function of {label}", value.func
        yield from ((f"argument {i} of {label}", a) for i, a in enumerate(value.args))
        yield from ((f"keyword argument {k!r} of {label}", v) for k, v in value.keywords.items())
    elif isinstance(value, types.MethodType):
        yield f"the object {label} is bound to", value.__self__
        yield label, value.__func__
    elif isinstance(value, types.FunctionType):
        name = f"{value.__qualname__}()"
        for global_name in sorted(_global_names(value.__code__)):
            if global_name in value.__globals__:
                yield f"global {global_name!r} used by {name}", value.__globals__[global_name]
        for var, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
            try:
                yield f"variable {var!r} that {name} closes over", cell.cell_contents
            except ValueError:  # an empty cell: nothing to send
                pass
        for i, default in enumerate(value.__defaults__ or ()):
            yield f"default value {i} of {name}", default
        for key, default in (value.__kwdefaults__ or {}).items():
            yield f"default of {key!r} in {name}", default


def _global_names(code: types.CodeType) -> set[str]:
    """Names ``code`` (and the functions and comprehensions nested in it) reads as globals."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names
