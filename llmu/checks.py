"""Argument checks shared by every kernel launcher (and by generation, for token ids).

A Triton kernel indexes raw memory: handed a tensor of the wrong shape, dtype, device or layout it
does not fail, it computes garbage. Launchers therefore validate their inputs with these helpers,
which raise ``TypeError``/``ValueError`` messages that name the argument and what was expected.
Checks of shapes, dtypes and devices cost nothing on the device; a check of values
(:func:`require_values`, :func:`require_token_ids`) reads data back to the host, so it runs once
per call, never once per step or per element.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable, Mapping

import torch

from llmu import runtime

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: While a list, :func:`require_tensor` appends ``(name, accepted dtypes, actual dtype)`` for every
#: check with ``dtypes``: ``llmu.gpu_compile`` reads it to see that it compiled each launcher for
#: every dtype the launcher accepts.
ACCEPTED_DTYPES: list | None = None


def require_tensor(
    name: str,
    x,
    *,
    ndim: int | Iterable[int] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | str | None = "kernel",
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Check that ``x`` is a tensor fit for a kernel launch; return it unchanged.

    ``device="kernel"`` (the default) asks for the device Triton kernels run on in the current
    mode: CPU tensors in interpreter mode, CUDA tensors when compiled.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.ndim not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if ACCEPTED_DTYPES is not None:
            ACCEPTED_DTYPES.append((name, dtypes, x.dtype))
        if x.dtype not in dtypes:
            want = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"{name} must have dtype {want}; got {str(x.dtype).removeprefix('torch.')}")
    if device is not None:
        want_dev = runtime.kernel_device() if device == "kernel" else torch.device(device)
        if x.device.type != want_dev.type:
            hint = (
                " (Triton runs in its interpreter on this machine: kernels take CPU tensors)"
                if runtime.interpreting()
                else " (Triton kernels run on the GPU: move the tensor with .cuda())"
            )
            raise ValueError(f"{name} must be on {want_dev.type}, got {x.device.type}{hint}")
    if last_dim_contiguous and x.ndim > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {x.stride()}")
    return x


def require_same_dtype(**tensors: torch.Tensor) -> torch.dtype:
    """All the given tensors share one dtype; return it."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; they must match")
    return first.dtype


def require_same_device(**tensors: torch.Tensor) -> torch.device:
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; they must match")
    return first.device


def require_int(name: str, value, minimum: int = 0) -> int:
    """``value`` as an int ``>= minimum`` (bools refused; numpy and torch integer scalars taken),
    or TypeError/ValueError naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def require_positive(name: str, value, *, integer: bool = False):
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be a positive {'int' if integer else 'number'}, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return value


def require_values(*checks: tuple[torch.Tensor, str]) -> None:
    """Raise ``ValueError(message)`` for the first ``(bad, message)`` whose ``bad`` is true.

    ``bad`` is a one-element bool tensor computed where the data lives, such as
    ``(x < 0).any()``. A value check has to read the data back to the host, and on a GPU that
    means waiting for it: all the flags are read in one go, one wait however many checks, never
    one per value. Tensors on ``meta`` have no values and are not checked.
    """
    if not checks:
        return
    flags = torch.stack([bad.reshape(()) for bad, _ in checks])
    if flags.device.type == "meta":
        return
    for hit, (_, message) in zip(flags.tolist(), checks):
        if hit:
            raise ValueError(message)


def require_token_ids(name: str, ids, vocab_size: int | None = None) -> list[int]:
    """``ids`` as a list of Python ints: at least one, each in ``[0, vocab_size)`` when given.

    ``ids`` is a list or tuple of ints (numpy's too), or an integer tensor ``(T,)`` or ``(1, T)``
    on any device (read back to the host once, not token by token). An id outside the vocabulary
    would otherwise fail deep inside the model's embedding lookup: an ``IndexError`` on a CPU, a
    device-side assert that breaks the CUDA context on a GPU.
    """
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got a tensor of dtype "
                            f"{str(ids.dtype).removeprefix('torch.')}")
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1:
            raise ValueError(f"{name} must be one sequence of token ids, shape (T,) or (1, T), "
                             f"got shape {tuple(ids.shape)}")
        out = ids.tolist()
    elif isinstance(ids, (list, tuple, range)):
        bad = next((i for i, t in enumerate(ids)
                    if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if bad is not None:
            raise TypeError(f"{name} must hold int token ids, got {name}[{bad}] = {ids[bad]!r}")
        out = [int(t) for t in ids]
    else:
        raise TypeError(f"{name} must be a list or a 1-D integer tensor of token ids, got {type(ids).__name__}")
    if not out:
        raise ValueError(f"{name} is empty: give at least one token")
    if vocab_size is not None and (min(out) < 0 or max(out) >= vocab_size):
        bad = next(i for i, t in enumerate(out) if not 0 <= t < vocab_size)
        raise ValueError(f"{name}[{bad}] = {out[bad]} is not a token id of this model: "
                         f"ids must be in [0, vocab_size) = [0, {vocab_size})")
    return out


def require_size(size, keys: tuple[str, ...]) -> tuple[int, ...]:
    """The positive ints ``size[key]`` for ``key`` in ``keys``, in that order (a benchmark size dict),
    or TypeError/ValueError naming the missing or bad key."""
    if not isinstance(size, Mapping):
        raise TypeError(f"size must be a dict with keys {keys}, got {type(size).__name__}")
    missing = [key for key in keys if key not in size]
    if missing:
        raise ValueError(f"size must have keys {keys}; missing {missing} in {dict(size)}")
    for key in keys:
        require_positive(f"size[{key!r}]", size[key], integer=True)
    return tuple(size[key] for key in keys)


def require_power_of_two(name: str, value: int) -> int:
    require_positive(name, value, integer=True)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


def require_attention_inputs(q, k, v, *, causal: bool = False) -> tuple[int, int, int, int, int, int]:
    """Check ``q`` ``(B, H, Tq, D)`` and ``k``, ``v`` ``(B, Hkv, Tk, D)`` for an attention kernel.

    One float dtype and the kernel device for all three; ``k`` and ``v`` of one shape; batch and
    head_dim shared with ``q``; ``H`` a multiple of ``Hkv`` (grouped-query attention); at least one
    key; and, when ``causal``, no more queries than keys (queries are the last ``Tq`` positions).
    Returns ``(B, H, Hkv, Tq, Tk, D)``. Limits of a particular kernel (head dims it supports,
    offsets) are checked by that kernel's launcher.
    """
    require_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    require_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES)
    require_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES)
    require_same_dtype(q=q, k=k, v=v)
    require_same_device(q=q, k=k, v=v)
    b, h, tq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != b:
        raise ValueError(f"k has batch size {k.shape[0]} but q has {b}")
    if k.shape[3] != d:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has {d}; q, k, v must share head_dim")
    if d == 0:
        raise ValueError("head_dim must be positive, got 0")
    hkv, tk = k.shape[1], k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"q has {h} heads, which must be a multiple of the number of KV heads ({hkv}) in k "
                         "(grouped-query attention)")
    if tk == 0 and tq > 0:
        raise ValueError("kv_len must be positive: a query cannot attend to zero keys")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if causal and tq > tk:
        raise ValueError(f"causal attention needs q_len <= kv_len (queries are the last q_len positions), "
                         f"got q_len={tq}, kv_len={tk}")
    return b, h, hkv, tq, tk, d
