"""Precompute the GQA-conversion perplexities the notebook of module 07 shows.

    python -m llmu.gqa.precompute            # writes llmu/data/gqa_perplexity.json
    python -m llmu.gqa.precompute --tokens 512 --variants gqa3 --out check.json   # a short check

Scores SmolLM2-135M-Instruct (float32) on the whole of ``llmu.data.text("essays")`` with the
strided evaluation of :func:`llmu.models.perplexity.perplexity`, as shipped and after each KV-head
conversion of :data:`VARIANTS`. It takes a few minutes on two CPU cores, which is why the notebook
reads the result instead of recomputing it (it recomputes a short prefix live to show that the
numbers come from this code).

Besides each variant's perplexity, the file keeps the evaluation's windows (``[begin, end,
first_scored]``, :func:`llmu.models.perplexity.windows`) and each variant's negative
log-likelihood summed over the tokens each window scores (``window_nll``): the perplexity is
``exp(sum(window_nll) / (tokens - 1))``, and any one window can be recomputed on its own in a
second or two. ``--tokens 512`` scores the first window alone (512 tokens are one window), which
is how the tests check a sample of the shipped table against a live run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

#: name -> (description, new KV heads or None for the model as shipped, method, layers or None for all)
VARIANTS = {
    "gqa3": ("as shipped: GQA, 3 KV heads in every layer", None, None, None),
    "mqa_mean": ("MQA: the 3 KV heads mean-pooled into 1, every layer", 1, "mean", None),
    "mqa_first": ("MQA: keep KV head 0 of 3, drop the others, every layer", 1, "first", None),
    "mqa_mean_layers_1_29": ("MQA by mean-pooling in layers 1-29, layer 0 left as GQA(3)", 1, "mean", list(range(1, 30))),
    "mqa_mean_second_half": ("MQA by mean-pooling in layers 15-29 only, GQA(3) in 0-14", 1, "mean", list(range(15, 30))),
    "mqa_first_second_half": ("MQA keeping head 0 in layers 15-29 only, GQA(3) in 0-14", 1, "first", list(range(15, 30))),
}

WINDOW, STRIDE = 512, 256


def evaluate(ids, window: int = WINDOW, stride: int = STRIDE, variants=None, model=None, log=print) -> dict:
    """Perplexity of every variant on ``ids``; returns name -> {description, perplexity, seconds,
    window_nll} (``window_nll``: the summed negative log-likelihood of the tokens each window of
    :func:`llmu.models.perplexity.windows` scores)."""
    from llmu.gqa.reference import convert_kv_heads
    from llmu.models import load_model
    from llmu.models.perplexity import token_nlls, windows

    model = load_model(dtype=torch.float32) if model is None else model
    spans = windows(len(ids), window, stride)
    out = {}
    for name in variants or VARIANTS:
        description, heads, method, layers = VARIANTS[name]
        m = model if heads is None else convert_kv_heads(model, heads, method=method, layers=layers)
        start = time.perf_counter()
        nll = token_nlls(m, ids, window=window, stride=stride)   # the evaluation of perplexity(), token by token
        seconds = time.perf_counter() - start
        ppl = math.exp(nll.mean().item())
        # nll[t - 1] is token t's: window (begin, end, first) scored tokens first .. end - 1
        window_nll = [nll[first - 1:end - 1].sum().item() for _, end, first in spans]
        out[name] = dict(description=description, perplexity=ppl, seconds=round(seconds, 1), window_nll=window_nll)
        log(f"{name:24s} {ppl:8.3f}   ({seconds:.0f} s)  {description}")
        del m
    return out


def main(argv=None) -> None:
    from llmu.data import text
    from llmu.models import load_tokenizer
    from llmu.models.perplexity import windows
    from llmu.runtime import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--stride", type=int, default=STRIDE)
    parser.add_argument("--tokens", type=int, default=None, help="score only the first TOKENS tokens (default: all)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "data" / "gqa_perplexity.json"))
    args = parser.parse_args(argv)

    ids = load_tokenizer().encode(text("essays"), add_special_tokens=False)
    if args.tokens is not None:
        if not 2 <= args.tokens <= len(ids):
            parser.error(f"--tokens must be between 2 and {len(ids)} (the essays' length in tokens)")
        ids = ids[:args.tokens]
    print(f"essays: {len(ids)} tokens, window {args.window}, stride {args.stride}")
    results = evaluate(ids, args.window, args.stride, variants=args.variants)
    record = dict(
        what="perplexity of SmolLM2-135M-Instruct (float32) on llmu.data.text('essays') after KV-head conversions",
        made_by=" ".join(["python -m llmu.gqa.precompute", *(argv if argv is not None else sys.argv[1:])]),
        text="essays", tokens=len(ids), window=args.window, stride=args.stride, dtype="float32",
        environment=str(environment()), threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d"),
        windows=[list(span) for span in windows(len(ids), args.window, args.stride)],
        variants=results,
    )
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
