"""LoRA: fine-tune a frozen model through small low-rank adapters (Hu et al., 2021).

Full fine-tuning updates every weight ``W`` (``out x in``) of a model, and AdamW keeps two more
numbers per weight: three copies of the model in memory. LoRA freezes ``W`` and learns the update
as a product of two thin matrices instead::

    y = x W^T + (alpha / r) * x A^T B^T          A: (r, in),  B: (out, r),  r << min(in, out)

so the adapted weight is ``W + (alpha/r) B A``, an update of rank at most ``r``. Each adapted
matrix costs ``r * (in + out)`` trainable numbers instead of ``in * out``: for SmolLM2's query
projection (576 x 576) at ``r = 8``, 9,216 instead of 331,776 (2.8 %).

Two details of the paper matter:

- ``B`` starts at zero and ``A`` at random (here Kaiming-uniform, as ``nn.Linear`` and the
  paper's reference code initialise it). The product ``B A`` is then zero: the adapted model
  starts *exactly* equal to the base model, and the first gradient step moves ``B`` (the gradient
  of ``B`` is ``(alpha/r) * dy^T (x A^T)``, non-zero because ``A`` is not).
- ``alpha / r`` scales the update so that changing ``r`` does not change how large the update is
  at a given learning rate; ``alpha`` is set once (often ``2 r``) and left alone.

After training the update can be *merged* into the weight, ``W <- W + (alpha/r) B A``: the model
is then an ordinary model again, with no extra matmul at inference. ``unmerge`` subtracts it back;
``unload_lora`` merges and removes the wrappers for good. ``lora_disabled`` runs the base model
without touching the weights (DPO's reference, :mod:`llmu.training.dpo`).

>>> from llmu.models import tiny_llama
>>> model = add_lora(tiny_llama(), targets=("q_proj", "v_proj"), r=4, alpha=8)
>>> parameter_counts(model).trainable == sum(lora_parameters(m.in_features, m.out_features, 4)
...                                          for m in lora_layers(model).values())
True
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmu.checks import require_positive

__all__ = [
    "LoRALinear",
    "ParameterCounts",
    "add_lora",
    "lora_disabled",
    "lora_layers",
    "lora_parameters",
    "lora_state_dict",
    "merge_lora",
    "parameter_counts",
    "unload_lora",
    "unmerge_lora",
]


def lora_parameters(in_features: int, out_features: int, r: int) -> int:
    """Trainable numbers of one adapted ``in -> out`` matrix: ``A`` is ``r x in``, ``B`` is ``out x r``."""
    for name, value in (("in_features", in_features), ("out_features", out_features), ("r", r)):
        require_positive(name, value, integer=True)
    return r * (in_features + out_features)


class LoRALinear(nn.Module):
    """A frozen projection ``base`` plus a trainable low-rank update ``(alpha/r) B A``.

    ``base``: any module with ``weight`` (``out x in``), ``in_features``, ``out_features`` (an
    llmu ``Linear``). Its parameters are frozen here. ``init``: ``"kaiming"`` (``A`` uniform in
    ``+-1/sqrt(in)``, what ``nn.Linear`` and the LoRA reference code use) or ``"gaussian"``
    (``A ~ N(0, 1/r^2)``, another common choice). ``B`` is always zero at the start.
    ``generator``: a ``torch.Generator`` for a reproducible ``A``.
    """

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16, *, init: str = "kaiming",
                 generator: torch.Generator | None = None):
        super().__init__()
        if isinstance(base, LoRALinear):
            raise TypeError("base is already a LoRALinear: adapters do not nest")
        weight = getattr(base, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise TypeError(f"base must be a linear layer with a 2-D weight, got {type(base).__name__}")
        if not weight.is_floating_point():
            raise TypeError(f"base.weight must be floating point (quantized layers cannot be merged into), "
                            f"got {weight.dtype}")
        require_positive("r", r, integer=True)
        require_positive("alpha", alpha)
        if init not in ("kaiming", "gaussian"):
            raise ValueError(f"init must be 'kaiming' or 'gaussian', got {init!r}")
        out_features, in_features = weight.shape
        if r > min(in_features, out_features):
            raise ValueError(f"r must be at most min(in_features, out_features) = {min(in_features, out_features)}, "
                             f"got {r}")
        self.base = base.requires_grad_(False)
        self.in_features, self.out_features = in_features, out_features
        self.r, self.alpha = r, alpha
        self.scaling = alpha / r
        self.merged = False
        self.enabled = True

        # A at random, B at zero: B @ A = 0, so the adapted layer starts equal to the base layer
        kw = dict(dtype=weight.dtype, device=weight.device)
        if init == "kaiming":
            # kaiming_uniform_(a=sqrt(5)) gives the bound gain * sqrt(3 / fan_in) with
            # gain = sqrt(2 / (1 + 5)): that is 1 / sqrt(in_features)
            bound = 1.0 / math.sqrt(in_features)
            a = torch.rand(r, in_features, generator=generator, dtype=torch.float32) * (2 * bound) - bound
        else:
            a = torch.randn(r, in_features, generator=generator, dtype=torch.float32) / r
        self.lora_A = nn.Parameter(a.to(**kw))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, **kw))

    def delta_weight(self) -> torch.Tensor:
        """The update ``(alpha/r) B A`` (``out x in``) that :meth:`merge` adds to the base weight."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged or not self.enabled:
            return y
        # two thin matmuls, never the full out x in update: x A^T is (..., r), then (..., out)
        return y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    @torch.no_grad()
    def merge(self) -> LoRALinear:
        """Fold the update into the base weight (``W <- W + (alpha/r) B A``); forward then skips the adapter.

        For inference: a merged layer gives no gradient to ``A`` and ``B``.
        """
        if self.merged:
            raise RuntimeError("this LoRALinear is already merged")
        self.base.weight += self.delta_weight()
        self.merged = True
        return self

    @torch.no_grad()
    def unmerge(self) -> LoRALinear:
        """Subtract the update again. ``(W + D) - D`` equals ``W`` only up to rounding: the sum was
        rounded to the weight's dtype when merging and the difference is rounded again, each by at
        most half a unit in the last place, so an entry can be off by about ``eps * (|W| + |D|)``
        (``eps = 1.2e-7`` in float32). Exact when ``D`` is zero or the sums happen to be exact."""
        if not self.merged:
            raise RuntimeError("this LoRALinear is not merged")
        self.base.weight -= self.delta_weight()
        self.merged = False
        return self

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, merged={self.merged}"


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The :class:`LoRALinear` modules of ``model`` by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def add_lora(model: nn.Module, targets: Iterable[str] = ("q_proj", "v_proj"), r: int = 8, alpha: float = 16, *,
             init: str = "kaiming", seed: int = 0) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap the projections named in ``targets`` in a
    :class:`LoRALinear` (in place; returns the model).

    ``targets``: last parts of the projection names (``"q_proj"``, ``"v_proj"``, ``"down_proj"``
    ...): the paper adapts the query and value projections, and adapting all seven projections of
    a block is also common. ``seed`` makes the ``A`` matrices reproducible.
    """
    if not hasattr(model, "replace_linears"):
        raise TypeError(f"model must be an llmu LlamaModel (with replace_linears), got {type(model).__name__}")
    if isinstance(targets, str):
        targets = (targets,)
    targets = tuple(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"targets must be a non-empty list of projection names such as 'q_proj', got {targets!r}")
    if lora_layers(model):
        raise ValueError("model already has LoRA adapters (merge or rebuild the model before adding more)")
    require_positive("r", r, integer=True)
    require_positive("alpha", alpha)

    # check every target first, so that a misspelt one leaves the model untouched
    available = {name.rsplit(".", 1)[-1] for name, _ in _projections(model)}
    missing = [t for t in targets if t not in available]
    if missing:
        raise ValueError(f"targets {missing} match no projection of the model; it has {sorted(available)}")

    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)

    def wrap(name: str, linear: nn.Module) -> nn.Module:
        if name.rsplit(".", 1)[-1] not in targets:
            return linear
        return LoRALinear(linear, r, alpha, init=init, generator=generator)

    model.replace_linears(wrap)
    return model


def _projections(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every projection ``replace_linears`` hands to its function."""
    found = []

    def record(name: str, module: nn.Module) -> nn.Module:
        found.append((name, module))
        return module     # unchanged: the model is not modified

    model.replace_linears(record)
    return found


def merge_lora(model: nn.Module) -> nn.Module:
    """Merge every adapter of ``model`` into its base weight (see :meth:`LoRALinear.merge`)."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("model has no LoRA adapters to merge")
    for layer in layers.values():
        layer.merge()
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo :func:`merge_lora` (up to float rounding, see :meth:`LoRALinear.unmerge`)."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("model has no LoRA adapters to unmerge")
    for layer in layers.values():
        layer.unmerge()
    return model


def unload_lora(model: nn.Module) -> nn.Module:
    """Merge every adapter and put the plain base projections back (in place; returns the model).

    The result is an ordinary model holding the fine-tuned weights, to which new adapters can be
    added: LoRA fine-tuning (SFT), then :func:`unload_lora`, then new adapters for DPO whose
    reference (the adapters switched off) is the fine-tuned model.
    """
    layers = lora_layers(model)
    if not layers:
        raise ValueError("model has no LoRA adapters to unload")
    for name, layer in layers.items():
        if not layer.merged:
            layer.merge()
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child_name, layer.base)
    return model


@contextmanager
def lora_disabled(model: nn.Module):
    """Inside this block the model computes as its base model (adapters switched off).

    DPO needs a frozen reference model: with LoRA the reference is the policy with its adapters
    off, so one copy of the weights serves both (SmolLM2 in float32 is 540 MB).
    """
    layers = lora_layers(model).values()
    if any(layer.merged for layer in layers):
        raise RuntimeError("unmerge the adapters before disabling them: a merged update is inside the weights")
    previous = [layer.enabled for layer in layers]
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer, was in zip(layers, previous):
            layer.enabled = was


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors (``...lora_A``, ``...lora_B``): what a fine-tune needs to save."""
    return {name: t for name, t in model.state_dict().items() if name.endswith(("lora_A", "lora_B"))}


@dataclass(frozen=True)
class ParameterCounts:
    """``trainable`` and ``total`` parameters; ``fraction`` = trainable / total."""

    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        return f"{self.trainable:,} trainable of {self.total:,} ({100 * self.fraction:.3f} %)"


def parameter_counts(model: nn.Module) -> ParameterCounts:
    """Trainable (``requires_grad``) and total parameters, a tensor shared by two modules (tied
    embeddings and LM head) counted once."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    seen, trainable, total = set(), 0, 0
    for p in model.parameters():   # parameters() already yields a shared Parameter once
        key = (p.data_ptr(), p.shape)
        if key in seen:
            continue
        seen.add(key)
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return ParameterCounts(trainable, total)
