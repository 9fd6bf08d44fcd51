"""Calibration data for GPTQ and AWQ, and a runner that feeds it through the blocks one at a time.

Round-to-nearest (RTN) quantizes a weight knowing nothing but the weight. GPTQ and AWQ also look
at the *inputs* each projection receives on real text, a few thousand tokens of it (the
*calibration set*), because the error that matters is the error of the layer's output
``(W - Q) X``, not of the weight itself.

Two pieces:

- :func:`calibration_ids`: ``n`` sequences of ``L`` tokens cut at random (seeded) offsets from a
  text, by default the course's own ``llmu.data.text("essays")``. :func:`essay_ids` and
  :func:`split_ids` give the token stream and its two halves (calibrate on the first, measure
  perplexity on the second: never on the tokens used to calibrate);
- :class:`BlockRunner`: holds the hidden states entering block ``i`` for every calibration
  sequence. ``runner.capture(layer, names)`` runs the block with forward hooks on the named
  projections and returns what each received, ``runner.advance(layer)`` moves the hidden states
  through the block. GPTQ quantizes block ``i``'s projections from their captured inputs,
  *then* advances through the **quantized** block, so block ``i + 1`` is calibrated on what it
  will really receive: the errors of the blocks before it included. Inside a block the
  projections are taken in the order the data flows (:data:`SEQUENTIAL_GROUPS`: q/k/v, then
  o_proj, then gate/up, then down_proj), each group seeing the outputs of the groups already
  quantized ("true sequential" in the GPTQ reference code).

Only the blocks run on the calibration data: the embedding lookup once at the start, never the
LM head over the 49,152-token vocabulary.
"""

from __future__ import annotations

import torch

__all__ = ["SEQUENTIAL_GROUPS", "BlockRunner", "calibration_ids", "essay_ids", "split_ids"]

#: The projections of a Llama block, grouped in the order the data reaches them. The projections
#: of one group read the same input (q, k and v read the normed hidden state; gate and up too).
SEQUENTIAL_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def essay_ids(tokenizer=None) -> torch.Tensor:
    """The token ids of ``llmu.data.text("essays")`` (about 5,000), a 1-D int64 tensor."""
    from llmu.data import text

    if tokenizer is None:
        from llmu.models import load_tokenizer

        tokenizer = load_tokenizer()
    return torch.tensor(tokenizer.encode(text("essays"), add_special_tokens=False), dtype=torch.long)


def split_ids(ids: torch.Tensor, fraction: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` cut in two at ``fraction`` of its length: (calibration part, evaluation part)."""
    ids = _check_ids(ids)
    if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"fraction must be a number in (0, 1), got {fraction!r}")
    cut = int(round(len(ids) * fraction))
    if cut < 2 or len(ids) - cut < 2:
        raise ValueError(f"cannot split {len(ids)} tokens at {fraction}: each part needs at least 2 tokens")
    return ids[:cut], ids[cut:]


def _check_ids(ids) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        ids = torch.tensor(list(ids), dtype=torch.long)
    if ids.ndim != 1 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"ids must be a 1-D sequence of integer token ids, got shape {tuple(ids.shape)} {ids.dtype}")
    return ids.long()


def calibration_ids(ids=None, *, n_samples: int = 16, seq_len: int = 256, seed: int = 0) -> torch.Tensor:
    """``(n_samples, seq_len)`` token ids: windows of ``ids`` starting at random (seeded) offsets.

    ``ids`` defaults to the first half of the essays (:func:`essay_ids`, :func:`split_ids`). The
    windows may overlap when the text is short; that is how a 2,500-token text gives 4,096
    calibration tokens. The same ``seed`` always gives the same windows.
    """
    if ids is None:
        ids = split_ids(essay_ids())[0]
    ids = _check_ids(ids)
    for name, value in (("n_samples", n_samples), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if len(ids) < seq_len:
        raise ValueError(f"seq_len {seq_len} is longer than the text ({len(ids)} tokens)")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len + 1, (n_samples,), generator=g)
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


class BlockRunner:
    """The hidden states entering one block, for every calibration sequence, moved block by block.

    >>> runner = BlockRunner(model, calibration_ids())              # doctest: +SKIP
    >>> for layer in model.layers:                                  # doctest: +SKIP
    ...     xs = runner.capture(layer, ["mlp.down_proj"])           # {name: (tokens, K) float32}
    ...     ...  # quantize the layer's projections
    ...     runner.advance(layer)                                   # through the quantized block

    ``batch_size`` sequences run together (memory: ``batch_size * seq_len`` tokens of hidden
    states per block call).
    """

    def __init__(self, model, ids: torch.Tensor, *, batch_size: int = 8):
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.is_floating_point():
            raise ValueError(f"ids must be (n_samples, seq_len) integer token ids, got "
                             f"{getattr(ids, 'shape', type(ids).__name__)}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not hasattr(model, "layers") or not hasattr(model, "embed_tokens"):
            raise TypeError(f"model must be an llmu LlamaModel, got {type(model).__name__}")
        self.model = model
        ids = ids.long().to(model.device)
        with torch.no_grad():
            self.hidden = [model.embed_tokens(ids[i:i + batch_size]) for i in range(0, len(ids), batch_size)]
        self.cos, self.sin = model.rope_tables(0, ids.shape[1])

    @property
    def tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)

    def _run(self, layer) -> list[torch.Tensor]:
        backend = self.model.attention_backend
        with torch.no_grad():
            return [layer(h, self.cos, self.sin, backend=backend)[0] for h in self.hidden]

    def capture(self, layer, names) -> dict[str, torch.Tensor]:
        """Run ``layer`` on the current hidden states; return each named submodule's input.

        ``names`` are paths inside the block (``"mlp.down_proj"``); each maps to its inputs over
        every calibration token, ``(tokens, in_features)`` float32. The hidden states do not move.
        """
        modules = dict(layer.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"names {missing} are not submodules of the layer (e.g. {SEQUENTIAL_GROUPS[0][0]!r})")
        seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        hooks = []
        for n in names:
            def hook(_module, args, _out, n=n):
                seen[n].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
            hooks.append(modules[n].register_forward_hook(hook))
        try:
            self._run(layer)
        finally:
            for h in hooks:
                h.remove()
        return {n: torch.cat(v) for n, v in seen.items()}

    def advance(self, layer) -> None:
        """Replace the hidden states by ``layer``'s outputs: the inputs of the next block."""
        self.hidden = self._run(layer)
