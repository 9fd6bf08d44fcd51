"""Perplexity of SmolLM2-135M-Instruct quantized with RTN, GPTQ and AWQ (module 10).

    python benchmarks/quant_perplexity.py results/quant_perplexity.json
    python benchmarks/quant_perplexity.py out.json --bits 4 3 --group-sizes 64 --schemes rtn gptq awq

Perplexity is measured on the Gospel of Luke in the King James Version (``llmu.data.text("luke_kjv")``,
public domain, 32,000 tokens; strided evaluation, ``llmu.models.perplexity``), and the calibration
windows come from the project's essays (``llmu.data.text("essays")``, about 5,000 tokens;
``llmu.quant.calibration.calibration_ids``): no calibration token is ever scored. With
``--eval-text essays`` the essays are cut in two instead, calibration from the first half, perplexity
on the second (a quicker run). Every scheme x bit width x
group size is one row of the table, written to the JSON file given on the command line (rewritten
after every row, so an interrupted run keeps what it measured), with the float32 reference and
the environment. On two CPU cores a row takes 10 to 60 seconds (GPTQ and AWQ run the 30 blocks
on the calibration tokens); the full table a few minutes to a quarter of an hour.

GPTQ's damping defaults to 0.1 here, not the paper's 0.01: the paper calibrates on 128 x 2048
tokens, this text has 2,500 to calibrate on, fewer than three times the 1,536 inputs of
``down_proj``. With so few tokens ``H`` is nearly singular, GPTQ fits the calibration tokens too
well (its error on them is half RTN's) and does worse than RTN on new text; more damping pulls
``H`` toward the identity, i.e. toward RTN, and generalises.

``recovered`` in a row is the fraction of RTN's perplexity increase (same bits and group size)
that the method wins back: ``(ppl_rtn - ppl) / (ppl_rtn - ppl_fp32)``; 1 is the float model's
perplexity, 0 no better than RTN.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main(argv=None) -> None:
    import llmu  # noqa: F401  (runtime setup first)
    from llmu.models import load_model, load_tokenizer
    from llmu.models.perplexity import perplexity
    from llmu.quant import model_nbytes, quantize_model
    from llmu.quant.calibration import calibration_ids, essay_ids, split_ids
    from llmu.runtime import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="path of the JSON file to write")
    parser.add_argument("--schemes", nargs="+", default=["rtn", "gptq", "awq"], choices=["rtn", "gptq", "awq"])
    parser.add_argument("--bits", nargs="+", type=int, default=[8, 4, 3, 2])
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[192, 64],
                        help="group sizes: each must divide 576 and 1536 (128 does not divide 576)")
    parser.add_argument("--n-samples", type=int, default=8, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--percdamp", type=float, default=0.1,
                        help="GPTQ damping (the paper's 0.01 overfits here: see the docstring)")
    parser.add_argument("--act-order", action="store_true", help="GPTQ with act_order (static groups)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--eval-text", default="luke_kjv", choices=["luke_kjv", "essays"],
                        help="luke_kjv (calibrate on all the essays) or essays (calibrate on the first half, "
                             "score the second)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = load_model(dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer()
    if args.eval_text == "essays":
        calib_part, eval_part = split_ids(essay_ids(tokenizer))
    else:
        from llmu.data import text

        calib_part = essay_ids(tokenizer)
        eval_part = torch.tensor(tokenizer.encode(text("luke_kjv"), add_special_tokens=False), dtype=torch.long)
    calib = calibration_ids(calib_part, n_samples=args.n_samples, seq_len=args.seq_len, seed=0)
    print(f"calibration: {tuple(calib.shape)} windows from {len(calib_part)} essay tokens; "
          f"evaluation: {len(eval_part)} tokens of {args.eval_text}, window {args.window}, stride {args.stride}")

    def ppl(m) -> float:
        return perplexity(m, eval_part, window=args.window, stride=args.stride)

    start = time.perf_counter()
    fp32 = ppl(model)
    record = dict(
        what=("perplexity of SmolLM2-135M-Instruct on llmu.data.text('luke_kjv'), quantized with "
              "RTN/GPTQ/AWQ calibrated on llmu.data.text('essays')" if args.eval_text == "luke_kjv" else
              "perplexity of SmolLM2-135M-Instruct on the second half of llmu.data.text('essays'), "
              "quantized with RTN/GPTQ/AWQ calibrated on the first half"),
        eval_text=args.eval_text,
        made_by="python benchmarks/quant_perplexity.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        calibration=dict(n_samples=args.n_samples, seq_len=args.seq_len, seed=0, tokens=len(calib_part)),
        evaluation=dict(tokens=len(eval_part), window=args.window, stride=args.stride),
        act_order=args.act_order, percdamp=args.percdamp, environment=str(environment()), date=time.strftime("%Y-%m-%d"),
        fp32=dict(perplexity=fp32, nbytes=model_nbytes(model), seconds=round(time.perf_counter() - start, 1)),
        rows=[],
    )
    print(f"{'fp32':6s} {'':>4s} {'':>5s} {fp32:9.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rtn = {}
    for gs in args.group_sizes:
        for bits in args.bits:
            for scheme in args.schemes:
                start = time.perf_counter()
                opts = dict(calibration=calib) if scheme != "rtn" else {}
                if scheme == "gptq":
                    opts.update(percdamp=args.percdamp, act_order=args.act_order)
                q = quantize_model(model, scheme, bits, group_size=gs, **opts)
                value = ppl(q)
                row = dict(scheme=scheme, bits=bits, group_size=gs, perplexity=value, nbytes=model_nbytes(q),
                           seconds=round(time.perf_counter() - start, 1))
                if scheme == "rtn":
                    rtn[(bits, gs)] = value
                elif (bits, gs) in rtn and rtn[(bits, gs)] != fp32:
                    row["recovered"] = (rtn[(bits, gs)] - value) / (rtn[(bits, gs)] - fp32)
                record["rows"].append(row)
                extra = f"  recovered {row['recovered']:.2f}" if "recovered" in row else ""
                print(f"{scheme:6s} {bits:4d} {gs:5d} {value:9.3f}   ({row['seconds']:.0f} s){extra}", flush=True)
                out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
                del q
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
