"""How notebook 03 grades the learner's decoder (its capstone): the statistics of a fresh module,
and the training recipe the grader runs itself, so that a learner's edits to the notebook cannot
change it.

The learner writes ``MyLM(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, rope_base,
eps, tie_embeddings)`` and ``my_load_weights(my_lm, model)``; llmu's answer is
:class:`llmu.layers.decoder.DecoderLM` with :func:`llmu.layers.decoder.load_llmu_weights`.

- :func:`init_report`: a fresh module's parameters, read without their names (count, and the
  statistics of every matrix and vector): every matrix ``N(0, 0.02²)``, every norm gain ones;
- :func:`llama_config`: the llmu ``LlamaConfig`` of a decoder of these arguments (its
  ``num_parameters()`` is the count the notebook states; ``llmu.models.make_trainable(config)``
  gives llmu's model of that shape with fresh weights);
- :func:`train_bytes`: ``steps`` steps of llmu's reference AdamW (``llmu.training.adamw``, the
  optimizer notebook 04 has the learner write) on random windows of a shipped text's UTF-8 bytes,
  at a constant learning rate; the losses, one per step. It trains anything whose forward maps ids
  to logits (a ``DecoderLM``, a learner's module) or to a ``ModelOutput`` (an llmu ``LlamaModel``).

The thresholds the notebook states come from :data:`MEASURED` (``python -m llmu.grading.decoder``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmu.layers.decoder import DecoderLM, load_llmu_weights, positive_int

__all__ = ["init_report", "llama_config", "train_bytes", "TRAIN_CONFIG", "TRAIN_RECIPE", "MEASURED"]


def llama_config(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, rope_base=10000.0, eps=1e-5,
                 tie_embeddings=False, max_len: int = 1024):
    """The llmu ``LlamaConfig`` of a :class:`DecoderLM` with these arguments (no special tokens)."""
    from llmu.models.config import LlamaConfig

    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
    return LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_ff, num_hidden_layers=n_layers,
                       num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=d_model // n_heads,
                       rope_theta=float(rope_base), rms_norm_eps=float(eps), max_position_embeddings=max_len,
                       tie_word_embeddings=bool(tie_embeddings), bos_token_id=None, eos_token_id=None,
                       pad_token_id=None, name="decoder-lm")


def init_report(module: nn.Module) -> dict:
    """What a fresh module's parameters look like, without their names: ``count`` (numbers, a
    shared parameter once), ``matrices`` (``(numel, mean, std)`` of every parameter with 2 or more
    dimensions), ``vectors`` (``(numel, min, max)`` of every 1-D one) and ``others`` (0-D ones)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    report = {"count": 0, "matrices": [], "vectors": [], "others": 0}
    with torch.no_grad():
        for p in module.parameters():               # parameters() yields a shared (tied) one once
            report["count"] += p.numel()
            w = p.detach().double()
            if p.ndim >= 2:
                report["matrices"].append((p.numel(), w.mean().item(), w.std().item()))
            elif p.ndim == 1:
                report["vectors"].append((p.numel(), w.min().item(), w.max().item()))
            else:
                report["others"] += 1
    return report


#: The small decoder the notebook trains: bytes in, two blocks 64 wide, 4 query heads sharing 2 KV heads.
TRAIN_CONFIG = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=176,
                    rope_base=10000.0, eps=1e-5, tie_embeddings=False)
#: The grader's training recipe (the keyword arguments of :func:`train_bytes`).
TRAIN_RECIPE = dict(steps=60, batch_size=8, seq_len=64, lr=3e-3, seed=0, text="essays")

#: ``python -m llmu.grading.decoder`` on the 2-core CPU machine (``train_bytes`` trains on one thread):
#: losses of :data:`TRAIN_RECIPE`. ``fresh_first``/``fresh_last5``: a fresh ``DecoderLM(**TRAIN_CONFIG)``
#: built after ``torch.manual_seed(s)``, s = 0..4, its first loss and the mean of its last 5 (``ln 256 =
#: 5.545``; the unigram entropy of the essays' bytes is 2.963 nats, what a model that ignores the
#: context can reach at best). ``same_weights_max_diff``: the largest difference over the 60 steps
#: between llmu's ``LlamaModel`` from ``make_trainable(config, seed=1)`` and a ``DecoderLM`` loaded
#: with the same weights (float32 rounding of the same arithmetic in another order).
MEASURED = {"fresh_first": [5.5491, 5.5176, 5.5659, 5.6024, 5.5402],
            "fresh_last5": [2.5603, 2.4214, 2.4947, 2.4468, 2.4389],
            "same_weights_max_diff": 2.1e-06, "unigram_entropy": 2.963}


def train_bytes(lm: nn.Module, steps: int = 60, *, batch_size: int = 8, seq_len: int = 64, lr: float = 3e-3,
                seed: int = 0, text: str = "essays", weight_decay: float = 0.0, threads: int | None = 1) -> list[float]:
    """Train ``lm`` for ``steps`` steps of next-byte prediction on the shipped ``text``; the losses.

    Each step draws ``batch_size`` random windows of ``seq_len + 1`` bytes (``llmu.training.batches.get_batch``
    with a generator seeded by ``seed``: the same windows for every model), takes the mean
    cross-entropy of ``lm(x)``'s logits against the next bytes, and makes one step of
    ``llmu.training.adamw.AdamW`` (``lr``, betas ``(0.9, 0.95)``, ``weight_decay``) over every
    parameter that requires a gradient. ``lm(x)`` may return the logits or an object with ``.logits``.
    Returns the ``steps`` losses (floats, nats per byte), each measured before its step's update.
    ``threads``: torch's CPU threads while it trains (restored after; ``None`` leaves them): one
    is as fast for a model this small, and on a CPU that other work keeps busy two threads can be
    many times slower.
    """
    from llmu.data import byte_tokens, text as shipped_text
    from llmu.training.adamw import AdamW
    from llmu.training.batches import get_batch

    if not isinstance(lm, nn.Module):
        raise TypeError(f"lm must be a torch.nn.Module, got {type(lm).__name__}")
    steps = positive_int("steps", steps)
    batch_size, seq_len = positive_int("batch_size", batch_size), positive_int("seq_len", seq_len)
    params = [p for p in lm.parameters() if p.requires_grad]
    if not params:
        raise ValueError("lm has no parameter that requires a gradient: nothing to train")
    tokens = byte_tokens(shipped_text(text))
    gen = torch.Generator().manual_seed(seed)
    opt = AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    device = params[0].device
    losses = []
    lm.train()
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(positive_int("threads", threads))
    try:
        for _ in range(steps):
            x, y = get_batch(tokens, batch_size, seq_len, device, generator=gen)
            out = lm(x)
            logits = getattr(out, "logits", out)
            if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or tuple(logits.shape[:2]) != (batch_size, seq_len):
                raise ValueError(f"lm(x) must give logits (B, T, vocab) = ({batch_size}, {seq_len}, vocab) for x "
                                 f"{tuple(x.shape)}, got {getattr(logits, 'shape', type(logits).__name__)}")
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(before)
    return losses


def _measure() -> dict:  # pragma: no cover - run by hand, see the module docstring
    from llmu.models.llama import make_trainable

    out = {}
    fresh = []
    for seed in range(5):
        torch.manual_seed(seed)
        fresh.append(train_bytes(DecoderLM(**TRAIN_CONFIG), **TRAIN_RECIPE))
    out["fresh_first"] = [round(r[0], 4) for r in fresh]
    out["fresh_last5"] = [round(sum(r[-5:]) / 5, 4) for r in fresh]
    config = llama_config(**TRAIN_CONFIG)
    ref = train_bytes(make_trainable(config, seed=1), **TRAIN_RECIPE)
    mine = train_bytes(load_llmu_weights(DecoderLM(**TRAIN_CONFIG), make_trainable(config, seed=1)), **TRAIN_RECIPE)
    out["same_weights_max_diff"] = max(abs(a - b) for a, b in zip(ref, mine))
    out["llmu_last5"] = round(sum(ref[-5:]) / 5, 4)
    from llmu.data import byte_tokens, text as shipped_text

    counts = torch.bincount(byte_tokens(shipped_text(TRAIN_RECIPE["text"])), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    out["unigram_entropy"] = round(-(p * p.log()).sum().item(), 3)
    return out


if __name__ == "__main__":  # pragma: no cover
    import time

    t0 = time.perf_counter()
    print(_measure(), f"{time.perf_counter() - t0:.1f} s")
