"""Quantizing a whole model: every projection of the blocks becomes a :class:`QuantLinear`.

>>> q4 = quantize_model(model, "rtn", bits=4, group_size=128)        # doctest: +SKIP
>>> model_nbytes(q4) / model_nbytes(model)                          # doctest: +SKIP

``method``:

- ``"rtn"`` (round to nearest): each weight matrix on its own, :func:`~llmu.quant.formats.quantize`;
  no data needed;
- ``"gptq"`` / ``"awq"``: use calibration activations to choose the rounding (GPTQ) or per-channel
  scales (AWQ); they live in ``llmu.quant.gptq`` / ``llmu.quant.awq`` and are imported when asked for.

The caller's model is never changed unless ``inplace=True``: by default the function works on a
deep copy (the weights of the layers being quantized are read from the original, not copied).
What is left alone: the embeddings, the norms, and the LM head when it is tied to the embeddings
(``LlamaModel.replace_linears`` skips it), and every layer named in ``skip``.
"""

from __future__ import annotations

import copy
import inspect
import re

import torch
import torch.nn as nn

from llmu.quant.formats import _check_format
from llmu.quant.linear import QuantLinear

__all__ = ["METHODS", "quantize_model", "model_nbytes", "quantized_layers", "from_gguf_model"]

METHODS = ("rtn", "gptq", "awq")


def _skipped(name: str, skip) -> bool:
    """``name`` is skipped when an entry of ``skip`` equals it or is a dotted suffix/prefix of it
    (``"down_proj"`` skips every ``mlp.down_proj``; ``"layers.0"`` skips layer 0's projections)."""
    return any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skip)


def quantize_model(model: nn.Module, method: str = "rtn", bits: int = 4, *, group_size: int = 128,
                   symmetric: bool = False, granularity: str = "group", inplace: bool = False, skip=(),
                   calibration=None, **method_options) -> nn.Module:
    """The model with the projections of its blocks quantized to ``bits`` (a copy unless ``inplace``).

    ``group_size``/``symmetric``/``granularity``: the format (``llmu.quant.formats``). ``skip``:
    names (or name suffixes such as ``"down_proj"``) of layers to keep in floating point.
    ``calibration``: token batches for ``"gptq"``/``"awq"`` (None: the method's default text; ``"rtn"``
    ignores it);
    ``method_options`` go to those methods as keywords.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not hasattr(model, "replace_linears"):
        raise TypeError(f"model must be an llmu LlamaModel (with replace_linears), got {type(model).__name__}")
    if isinstance(skip, str):
        skip = (skip,)
    skip = tuple(skip)
    # validate the format on every layer first: a bad group size fails before anything is copied
    for name, module in _linears(model):
        if not _skipped(name, skip):
            try:
                _check_format(bits, granularity, group_size, module.in_features)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
    if method != "rtn":
        return _dispatch(model, method, bits=bits, group_size=group_size, symmetric=symmetric,
                         granularity=granularity, inplace=inplace, skip=skip, calibration=calibration,
                         **method_options)
    if method_options:
        raise TypeError(f"method 'rtn' takes no options, got {sorted(method_options)}")
    target = model if inplace else _copy_without(model, [m for n, m in _linears(model) if not _skipped(n, skip)])

    def replace(name: str, linear: nn.Module) -> nn.Module:
        if _skipped(name, skip):
            return linear
        return QuantLinear.from_linear(linear, bits, symmetric=symmetric, granularity=granularity,
                                       group_size=group_size)

    with torch.no_grad():
        return target.replace_linears(replace)


def _copy_without(model: nn.Module, replaced) -> nn.Module:
    """A deep copy of ``model`` in which the float weights of the ``replaced`` layers are *shared*
    with the original instead of copied: they are about to be replaced by codes anyway, and copying
    them first would double the model's memory for nothing (2 GB Binder machines notice).

    The token embedding (and the LM head tied to it) is shared too, as a new ``Parameter`` over the
    same storage: no method here writes to it, it is the largest float matrix left after
    quantization (113 MB for SmolLM2 in float32), and a new ``Parameter`` keeps ``copy.to(dtype)``
    from converting the original's."""
    memo = {}
    for linear in replaced:
        for t in (getattr(linear, "weight", None), getattr(linear, "bias", None)):
            if t is not None:
                memo[id(t)] = t
    embedding = getattr(getattr(model, "embed_tokens", None), "weight", None)
    if isinstance(embedding, nn.Parameter) and id(embedding) not in memo:
        memo[id(embedding)] = nn.Parameter(embedding.data, requires_grad=embedding.requires_grad)
    return copy.deepcopy(model, memo)


def _linears(model: nn.Module):
    """``(name, module)`` of every projection ``replace_linears`` would hand to its function."""
    found = []

    def record(name, module):
        found.append((name, module))
        return module

    model.replace_linears(record)  # returns each module unchanged: the model is not modified
    return found


def _dispatch(model, method: str, **options):
    """Call ``llmu.quant.gptq.quantize_model_gptq`` or ``llmu.quant.awq.quantize_model_awq``.

    Options the method does not take are dropped when they hold their default, and refused
    otherwise (a silently ignored ``skip`` would be a wrong answer).
    """
    if method == "gptq":
        from llmu.quant.gptq import quantize_model_gptq as fn
    else:
        from llmu.quant.awq import quantize_model_awq as fn
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        defaults = dict(granularity="group", skip=(), symmetric=False, inplace=False)
        for key in list(options):
            if key not in params:
                if key in defaults and options[key] == defaults[key]:
                    del options[key]
                else:
                    raise TypeError(f"quantize_model_{method} does not take {key}={options[key]!r}")
    return fn(model, **options)


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """Name -> :class:`QuantLinear` for every quantized layer of ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def model_nbytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: a :class:`QuantLinear` counts its packed codes and
    fp16 scales (``QuantLinear.nbytes``), every other parameter its elements times their size.
    A tensor shared by two modules (tied embeddings and LM head) counts once; caches do not count."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.nbytes
            continue
        for p in module.parameters(recurse=False):
            key = (p.data_ptr(), p.numel(), p.dtype)
            if key not in seen:
                seen.add(key)
                total += p.numel() * p.element_size()
    return total



def from_gguf_model(model: nn.Module, path=None, *, inplace: bool = False) -> nn.Module:
    """The model with each projection of its blocks read back as the GGUF file's own Q4_1 blocks.

    ``model`` is SmolLM2 as ``llmu.models.load_model`` builds it (its float weights are the Q4_1
    values of the file, dequantized); here every projection becomes a :class:`QuantLinear` holding
    the file's codes, ``d`` and ``m`` (:func:`~llmu.quant.formats.from_gguf`), so the layers compute
    with the very same numbers, now stored at 5 bits per weight. With ``rope_layout="half"`` the rows
    of ``q_proj`` and ``k_proj`` are put in Hugging Face order as the loader does
    (``llmu.models.loading``); every field of a row (codes, scales, zeros, offsets) moves with it.
    """
    from llmu.models.gguf_file import GGUFFile
    from llmu.models.loading import GGUF_TO_HF, unpermute_rope_rows
    from llmu.quant.formats import QuantizedTensor, from_gguf

    if not hasattr(model, "replace_linears"):
        raise TypeError(f"model must be an llmu LlamaModel (with replace_linears), got {type(model).__name__}")
    heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
    with GGUFFile(path) as f:
        hf_to_gguf = {}
        for name in f.tensor_names():
            for pattern, hf in GGUF_TO_HF.items():
                if re.fullmatch(pattern, name):
                    hf_to_gguf[re.sub(pattern, hf, name)] = name

        def replace(name: str, linear: nn.Module) -> nn.Module:
            gguf_name = hf_to_gguf.get(f"{name}.weight")
            if gguf_name is None:
                raise ValueError(f"the GGUF file has no tensor for {name}")
            t = f.tensor(gguf_name)
            if tuple(t.shape) != (linear.out_features, linear.in_features):
                raise ValueError(f"{name}: the file's {gguf_name} is {tuple(t.shape)}, the model's layer is "
                                 f"{(linear.out_features, linear.in_features)}")
            qt = from_gguf(t)
            n_heads = heads.get(name.rsplit(".", 1)[-1])
            if n_heads is not None and model.config.rope_layout == "half":
                codes, scale, zero, offset = (unpermute_rope_rows(x, n_heads).contiguous()
                                              for x in (qt.codes, qt.scale, qt.zero, qt.offset))
                qt = QuantizedTensor(codes, scale, zero, qt.bits, qt.group_size, qt.symmetric, qt.granularity,
                                     qt.dtype, offset=offset)
            return QuantLinear(qt)

        target = model if inplace else _copy_without(model, [m for _, m in _linears(model)])
        return target.replace_linears(replace)
