"""Perplexity of SmolLM2-135M-Instruct quantized with RTN, GPTQ and AWQ (module 10).

    python benchmarks/quant_perplexity.py                      # writes llmu/data/quant_perplexity.json
    python benchmarks/quant_perplexity.py --resume             # adds the rows the file lacks
    python benchmarks/quant_perplexity.py --out t.json --bits 3 --group-sizes 64

The text is the Gospel of Luke in the King James Version (``llmu.data.text("luke_kjv")``, public
domain, 32,000 tokens). Its first quarter (``--calib-fraction``) is the calibration text of GPTQ
and AWQ (``--n-samples`` windows of ``--seq-len`` tokens at seeded random offsets,
``llmu.quant.calibration.calibration_ids``); the rest, 24,000 tokens, is scored with the strided
evaluation of ``llmu.models.perplexity`` (``--window``, ``--stride``): no calibration token is ever
scored. With ``--eval-text essays`` the course's essays are cut in two instead (a quick run on
5,000 tokens).

Every scheme x bit width x group size is one row of the table, in order of interest (every
scheme in groups of 64 first, 3 and 4 bits first; then the other group sizes, quick schemes first), written to the JSON file after every row: an interrupted run keeps
what it measured, and ``--resume`` computes only the rows the file does not hold yet (with the
same settings; a file made with other settings is refused). On two CPU cores a row takes one to
four minutes (each perplexity evaluation about 80 s; GPTQ and AWQ first run the calibration set
through every block), the whole table one to two hours.

The file also holds ``live_check``: the reference and RTN at 4 bits in groups of 64 scored on the
first 2,048 evaluation tokens only, which module 10's notebook recomputes in seconds to show that
the table comes from this code.

``recovered`` in a row is the fraction of RTN's perplexity increase (same bits and group size)
that the method wins back: ``(ppl_rtn - ppl) / (ppl_rtn - ppl_ref)``; 1 is the reference's
perplexity, 0 no better than RTN. The reference is the model as the course loads it: the file's
Q4_1 weights dequantized to float32.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "llmu" / "data" / "quant_perplexity.json"
SCHEMES = ("rtn", "gptq", "awq")
#: The settings a resumed file must share with the command line.
SETTINGS = ("eval_text", "calibration", "evaluation", "percdamp", "act_order")


def plan(group_sizes, bits, schemes) -> list[tuple[str, int, int]]:
    """Rows in order of interest: every scheme at the first group size (bit widths 3, 4, 2, 8 of those
    asked for, RTN first: the methods' ``recovered`` needs it), then the other group sizes scheme by
    scheme, the quick ones first (RTN, then GPTQ, then AWQ)."""
    order = [b for b in (3, 4, 2, 8) if b in bits] + [b for b in bits if b not in (3, 4, 2, 8)]
    chosen = [s for s in SCHEMES if s in schemes]
    first = [(s, b, group_sizes[0]) for b in order for s in chosen]
    return first + [(s, b, g) for s in chosen for g in group_sizes[1:] for b in order]


def main(argv=None) -> None:
    import llmu  # noqa: F401  (runtime setup first)
    from llmu.bench.results import resumable
    from llmu.data import text
    from llmu.models import load_model, load_tokenizer
    from llmu.models.perplexity import perplexity
    from llmu.quant import model_nbytes, quantize_model
    from llmu.quant.calibration import calibration_ids, essay_ids, split_ids
    from llmu.runtime import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON file to write (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in --out; compute the others")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--bits", nargs="+", type=int, default=[8, 4, 3, 2])
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[64, 32, 192],
                        help="group sizes: each must divide 576 and 1536 (128 does not divide 576)")
    parser.add_argument("--n-samples", type=int, default=16, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--calib-fraction", type=float, default=0.25,
                        help="the leading fraction of the text kept for calibration (never scored)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=384)
    parser.add_argument("--percdamp", type=float, default=0.1, help="GPTQ damping (fraction of mean diag H)")
    parser.add_argument("--act-order", action="store_true", help="GPTQ with act_order (static groups)")
    parser.add_argument("--live-tokens", type=int, default=2048, help="evaluation tokens of the live check")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--eval-text", default="luke_kjv", choices=["luke_kjv", "essays"])
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = load_model(dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer()
    ids = essay_ids(tokenizer) if args.eval_text == "essays" else \
        torch.tensor(tokenizer.encode(text("luke_kjv"), add_special_tokens=False), dtype=torch.long)
    calib_part, eval_part = split_ids(ids, args.calib_fraction)
    calib = calibration_ids(calib_part, n_samples=args.n_samples, seq_len=args.seq_len, seed=0)
    print(f"calibration: {tuple(calib.shape)} windows from the first {len(calib_part)} tokens of {args.eval_text}; "
          f"evaluation: the other {len(eval_part)} tokens, window {args.window}, stride {args.stride}", flush=True)

    def ppl(m, tokens=eval_part) -> float:
        return perplexity(m, tokens, window=args.window, stride=args.stride)

    settings = dict(
        eval_text=args.eval_text,
        calibration=dict(fraction=args.calib_fraction, n_samples=args.n_samples, seq_len=args.seq_len, seed=0,
                         tokens=len(calib_part)),
        evaluation=dict(tokens=len(eval_part), window=args.window, stride=args.stride),
        percdamp=args.percdamp, act_order=args.act_order,
    )
    out = Path(args.out)
    record = resumable(out, settings, SETTINGS) if args.resume else None
    if record is None:
        start = time.perf_counter()
        ref = ppl(model)
        live_ids = eval_part[:args.live_tokens]
        rtn4 = quantize_model(model, "rtn", 4, group_size=64)
        record = dict(
            what=f"perplexity of SmolLM2-135M-Instruct on {args.eval_text} (all but the first "
                 f"{args.calib_fraction:.0%}), quantized with RTN/GPTQ/AWQ calibrated on that first part",
            **settings,
            made_by=" ".join(["python benchmarks/quant_perplexity.py", *(argv if argv is not None else sys.argv[1:])]),
            environment=str(environment()), date=time.strftime("%Y-%m-%d"),
            fp32=dict(perplexity=ref, nbytes=model_nbytes(model), seconds=round(time.perf_counter() - start, 1)),
            live_check=dict(tokens=len(live_ids), scheme="rtn", bits=4, group_size=64,
                            reference=ppl(model, live_ids), perplexity=ppl(rtn4, live_ids)),
            rows=[],
        )
        del rtn4
        print(f"{'ref':6s} {'':>4s} {'':>5s} {ref:9.3f}", flush=True)
    ref = record["fp32"]["perplexity"]
    done = {(r["scheme"], r["bits"], r["group_size"]) for r in record["rows"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    for scheme, bits, gs in plan(args.group_sizes, args.bits, args.schemes):
        if (scheme, bits, gs) in done:
            continue
        start = time.perf_counter()
        opts = dict(calibration=calib) if scheme != "rtn" else {}
        if scheme == "gptq":
            opts.update(percdamp=args.percdamp, act_order=args.act_order)
        q = quantize_model(model, scheme, bits, group_size=gs, **opts)
        value = ppl(q)
        row = dict(scheme=scheme, bits=bits, group_size=gs, perplexity=value, nbytes=model_nbytes(q),
                   seconds=round(time.perf_counter() - start, 1))
        del q
        rtn = [r["perplexity"] for r in record["rows"] if (r["scheme"], r["bits"], r["group_size"]) == ("rtn", bits, gs)]
        if scheme != "rtn" and rtn and rtn[0] != ref:
            row["recovered"] = (rtn[0] - value) / (rtn[0] - ref)
        record["rows"].append(row)
        extra = f"  recovered {row['recovered']:.2f}" if "recovered" in row else ""
        print(f"{scheme:6s} {bits:4d} {gs:5d} {value:9.3f}   ({row['seconds']:.0f} s){extra}", flush=True)
        out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
