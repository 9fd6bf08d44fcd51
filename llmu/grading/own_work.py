"""Is the submission the learner's own? A check that a graded function does not hand back a ready-made answer.

Every notebook imports llmu, so the library's version of an exercise is one name away: a learner
could write ``my_pack = engine_pack``, or ``def my_pack(*a): return engine_pack(*a)``, and pass a
test that compares with that very function. :func:`check_own_work` reads the submission's code
(its bytecode, not its text) and fails when it *is* the library's answer or *refers to* it:

* the object itself, a copy of its code, a subclass, a ``functools.partial`` or a ``@wraps``
  wrapper around it, and an object of an answer class (its methods compute the answer);
* any name the submission's code loads, with attribute chains followed (``llmu.paged.engine_pack``,
  ``F.scaled_dot_product_attention``) and imports inside the function resolved;
* default arguments and closure variables;
* recursively, every function, class or Triton kernel defined in the notebook (same globals) that
  the submission reaches: a helper that calls the answer counts.

Each exercise names its answers in its hidden tests, so using *other* parts of llmu (the checks,
an earlier exercise's reference) stays allowed. Source copied out of the library is not detected:
this check closes the one-line loophole, not plagiarism.
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import functools
import importlib
import sys
import types

from .errors import CheckFailed

__all__ = ["check_own_work", "find_library_answer", "resolve"]


def resolve(answer):
    """``answer`` as an object: a dotted path ``"llmu.paged.engine_pack"`` is imported, anything else
    is returned as it is."""
    if not isinstance(answer, str):
        return answer
    parts = answer.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ValueError(f"answers: cannot import {answer!r}")


def _name(obj) -> str:
    fn = getattr(obj, "fn", None)  # a Triton JITFunction wraps the Python function
    target = fn if callable(fn) and hasattr(fn, "__code__") else obj
    module = getattr(target, "__module__", None)
    if not isinstance(target, (types.FunctionType, type)):  # a builtin (torch's C functions): its plain name
        return getattr(target, "__name__", None) or repr(target)
    qual = getattr(target, "__qualname__", None) or target.__name__
    return f"{module}.{qual}" if module and module not in ("builtins", "__main__") else qual


#: Triton's decorators keep the decorated function (or the next decorator) in ``.fn``.
_TRITON_WRAPPERS = ("JITFunction", "InterpretedFunction", "Autotuner", "Heuristics")


def _unwrap(obj):
    """What ``obj`` stands for: the function of a Triton kernel, a method or a partial."""
    if isinstance(obj, functools.partial):
        return obj.func
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    if isinstance(obj, types.MethodType):
        return obj.__func__
    if type(obj).__name__ in _TRITON_WRAPPERS and getattr(obj, "fn", None) is not None:
        return obj.fn
    return obj


class _Answers:
    """The library's answers, matched by identity, by code object and by subclassing."""

    def __init__(self, answers):
        self.objects = [resolve(a) for a in answers]
        # how to name each in a message: as the check wrote it (a dotted path), else where it is defined
        self.labels = {id(o): a if isinstance(a, str) else _name(o) for a, o in zip(answers, self.objects)}
        self.codes = {}
        self.classes = []
        for a in self.objects:
            base, nxt = a, _unwrap(a)
            while nxt is not base:
                base, nxt = nxt, _unwrap(nxt)
            if isinstance(base, types.FunctionType):
                self.codes[base.__code__] = a
            if isinstance(a, type):
                self.classes.append(a)

    def match(self, obj):
        """The answer ``obj`` is (or wraps, or subclasses), else None."""
        seen = 0
        while obj is not None and seen < 8:
            seen += 1
            for a in self.objects:
                if obj is a:
                    return a
            for c in self.classes:
                try:
                    if issubclass(obj, c) if isinstance(obj, type) else isinstance(obj, c):
                        return c  # the class, a subclass, or an object of it (whose methods answer)
                except TypeError:
                    pass
            code = getattr(obj, "__code__", None)
            if code is not None and code in self.codes:
                return self.codes[code]
            nxt = getattr(obj, "__wrapped__", None)
            if nxt is None:
                nxt = _unwrap(obj)
            if nxt is obj:
                return None
            obj = nxt
        return None


def _import(name: str, fromlist):
    module = sys.modules.get(name)
    try:
        if module is None:
            module = importlib.import_module(name)
        return module if fromlist else sys.modules.get(name.partition(".")[0])
    except Exception:  # noqa: BLE001 - an import that fails here fails in the learner's code too
        return None


def _referenced(code: types.CodeType, globals_: dict, closure: dict):
    """Every object the code loads by name or attribute chain: ``(object, how it was written)``."""
    locals_: dict = {}
    current, path, const = None, "", None
    for ins in dis.get_instructions(code):
        op, arg = ins.opname, ins.argval
        if op in ("CACHE", "EXTENDED_ARG", "NOP", "PRECALL", "RESUME", "PUSH_NULL", "COPY_FREE_VARS",
                  "MAKE_CELL"):
            continue
        if op == "LOAD_CONST":
            const = arg
            if isinstance(arg, types.CodeType):
                yield from _referenced(arg, globals_, {**closure, **locals_})
            current, path = None, ""
            continue
        if op in ("LOAD_GLOBAL", "LOAD_NAME"):
            name = arg
            current = globals_.get(name, getattr(builtins, name, None)) if name not in locals_ else locals_[name]
            path = name
        elif op in ("LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR"):
            current = locals_.get(arg, closure.get(arg))
            path = arg
        elif op in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM") and current is not None:
            current = getattr(current, arg, None)
            path = f"{path}.{arg}"
        elif op == "IMPORT_NAME":
            fromlist = const if isinstance(const, tuple) else None
            current = _import(arg, fromlist)
            path = arg if fromlist else arg.partition(".")[0]
        elif op in ("STORE_FAST", "STORE_DEREF", "STORE_NAME", "STORE_GLOBAL"):
            if current is not None:
                locals_[arg] = current
            current, path = None, ""
            continue
        else:
            current, path = None, ""
            continue
        if current is not None:
            yield current, path


def _children(obj):
    """What the submission ``obj`` refers to, with the way it was written, one level down."""
    obj = _unwrap(obj)
    if isinstance(obj, functools.partial):
        yield obj.func, "partial"
    if isinstance(obj, types.FunctionType):
        closure = {}
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                closure[name] = cell.cell_contents
            except ValueError:  # an empty cell
                pass
        for value in list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values()):
            yield value, "a default argument"
        for name, value in closure.items():
            yield value, name
        yield from _referenced(obj.__code__, obj.__globals__, closure)
    elif isinstance(obj, type):
        for base in obj.__mro__[1:]:
            yield base, f"base class {base.__name__}"
        for name, value in vars(obj).items():
            if name.startswith("__") and name not in ("__init__", "__call__"):
                continue
            if isinstance(value, property):
                for part in (value.fget, value.fset):
                    if part is not None:
                        yield part, f"{obj.__name__}.{name}"
            else:
                yield value, f"{obj.__name__}.{name}"


def _is_notebook_code(obj, globals_: dict) -> bool:
    """Defined where the submission was (the notebook's namespace), so worth reading too."""
    obj = _unwrap(obj)
    if isinstance(obj, types.FunctionType):
        return obj.__globals__ is globals_
    if isinstance(obj, type):  # a class whose methods were defined there
        return any(isinstance(_unwrap(v), types.FunctionType) and _unwrap(v).__globals__ is globals_
                   for v in vars(obj).values())
    return False


def find_library_answer(submission, answers) -> tuple[object, list[str]] | None:
    """The first of ``answers`` that ``submission`` is or refers to, with the chain of names that
    leads there (``["my_pack", "helper", "engine_pack"]``); None when it stays clear of them."""
    return _find(submission, _Answers(answers))


def _find(submission, table: _Answers) -> tuple[object, list[str]] | None:
    root = _unwrap(submission)
    globals_ = getattr(root, "__globals__", None)
    if globals_ is None and isinstance(root, type):
        for value in vars(root).values():
            value = _unwrap(value)
            if isinstance(value, types.FunctionType):
                globals_ = value.__globals__
                break
    globals_ = globals_ if globals_ is not None else {}
    start = getattr(submission, "__name__", None) or getattr(_unwrap(submission), "__name__", "submission")
    stack = [(submission, [start])]
    visited: set[int] = set()
    while stack:
        obj, chain = stack.pop()
        found = table.match(obj)
        if found is not None:
            return found, chain
        key = id(_unwrap(obj))
        if key in visited or len(chain) > 12:
            continue
        visited.add(key)
        if len(chain) > 1 and not _is_notebook_code(obj, globals_):
            continue  # llmu, torch, the standard library: not the learner's code, not read
        for child, how in _children(obj):
            if isinstance(child, types.ModuleType):
                continue
            stack.append((child, chain + [how]))
    return None


_LOOK_AT = ("  Look at: write it in the cell yourself (reading llmu's version afterwards is encouraged); "
            "other llmu helpers and torch's building blocks are fine.")


class _Tripwire(Exception):
    """Raised in place of an answer called while ``run`` runs (not an AssertionError: a learner's
    ``except AssertionError`` cannot swallow it, and every call is recorded anyway)."""


#: The calls recorded by the tripwires in place (see :func:`_tripwires`), or None.
_TRIPPED: list | None = None


def _trip(label: str):
    if _TRIPPED is not None:
        _TRIPPED.append(label)
    raise _Tripwire(label)


def _tripwire_code(label: str) -> types.CodeType:
    """The code of a function that calls :func:`_trip` (it lives in the answer's own function
    object while the tripwire is in place, so every reference to that function trips it)."""
    ns: dict = {}
    exec(f"def tripped(*args, **kwargs):\n    import llmu.grading.own_work as m\n    m._trip({label!r})\n", ns)  # noqa: S102
    return ns["tripped"].__code__


@contextlib.contextmanager
def _tripwires(table: _Answers):
    """While inside, calling an answer class's ``forward``/``__call__`` or an answer function (one
    without closure variables) records the call in the list this yields and raises :class:`_Tripwire`."""
    global _TRIPPED
    patched = []
    calls: list = []
    previous, _TRIPPED = _TRIPPED, calls
    try:
        for obj in table.objects:
            label = table.labels[id(obj)]
            if isinstance(obj, type):
                for name in ("forward", "__call__"):
                    if isinstance(vars(obj).get(name), types.FunctionType):
                        patched.append((obj, name, vars(obj)[name]))
                        setattr(obj, name, types.FunctionType(_tripwire_code(f"{label}.{name}"), {}))
            else:
                fn = _unwrap(obj)
                if isinstance(fn, types.FunctionType) and not fn.__code__.co_freevars:
                    patched.append((fn, "__code__", fn.__code__))
                    fn.__code__ = _tripwire_code(label)
        yield calls
    finally:
        for owner, name, value in reversed(patched):
            setattr(owner, name, value)
        _TRIPPED = previous


def check_own_work(submission, *answers, what: str, run=None) -> None:
    """Fail unless ``submission`` is the learner's own code, clear of every one of ``answers``.

    ``answers`` are llmu's (or torch's) functions, classes or Triton kernels that solve the same
    exercise, as objects or dotted paths::

        check_own_work(my_pack, "llmu.paged.engine_pack", what="exercise 1 (packing a batch)")

    The code is read, not run. An exercise whose function is *handed* a library object (a decoder
    layer, the model) can pass ``run``, a call of the submission on a small input: it runs while
    each answer class's ``forward`` and each answer function raise when called, so that
    ``return layer(x)`` fails too::

        check_own_work(decoder_block, DecoderLayer, what="exercise 5",
                       run=lambda: decoder_block(x, model.layers[0], cos, sin, cfg))
    """
    if not answers:
        raise ValueError("answers: name at least one library function this exercise must not use")
    if not isinstance(what, str) or not what:
        raise TypeError(f"what must be a non-empty str, got {what!r}")
    if run is not None and not callable(run):
        raise TypeError(f"run must be a callable taking no arguments, got {type(run).__name__}")
    if submission is None:
        raise CheckFailed(f"{what}: the submission is None; did the solution cell run?")
    table = _Answers(answers)
    hit = _find(submission, table)
    if hit is not None:
        answer, chain = hit
        raise CheckFailed(
            f"{what}: your code uses {table.labels.get(id(answer), _name(answer))}, a ready-made answer to "
            f"this exercise ({' -> '.join(chain)}); the exercise is graded on code you write, so it scores "
            "nothing while that call is there.\n" + _LOOK_AT)
    if run is None:
        return
    with _tripwires(table) as calls:
        try:
            run()
        except Exception:  # noqa: BLE001 - the learner's own errors are the rest of the test's business
            pass
    if calls:
        raise CheckFailed(
            f"{what}: while it ran, your code called {calls[0]}, a ready-made answer to this exercise (on an "
            "object it was given); the exercise is graded on code you write, so it scores nothing while that "
            "call is there.\n" + _LOOK_AT)
