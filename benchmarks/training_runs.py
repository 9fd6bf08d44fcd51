"""The long training runs of module 04, recorded for the notebook: pretraining, SFT with LoRA, DPO.

    python benchmarks/training_runs.py                    # writes llmu/data/training_runs.json
    python benchmarks/training_runs.py --out t.json --pretrain-steps 40 --sft-steps 2 --dpo-steps 2

Notebook 04 runs the same functions (``llmu.training.runs``) for a few steps live, within its
two-minute budget; this script runs them long enough for the curves to say something, and the
notebook draws its live steps over the recorded ones:

1. ``pretrain``: :func:`~llmu.training.runs.pretrain_small`, a byte-level Llama (128 wide, 2
   blocks) from scratch on the first 90 % of ``essays.txt``; the loss of every step and the
   held-out loss on the last 10 %, every 25 steps.
2. ``sft``: SmolLM2-135M-Instruct with LoRA adapters (r = 8, alpha = 16, all seven projections)
   fine-tuned by :func:`~llmu.training.runs.sft_lora` on the first 36 examples of
   ``sft_examples.json``; the last 4 are held out, and the model's greedy answers to them are
   recorded before and after.
3. ``dpo``: the SFT adapters are merged into the weights (``unload_lora``: the SFT model is now the
   reference) and new adapters trained by :func:`~llmu.training.runs.dpo_lora` on the first 24
   pairs of ``preference_pairs.json``: loss, implicit reward margin and accuracy per step, and the
   same three on the 6 held-out pairs before and after; the held-out answers again at the end.

Everything is seeded and runs on one CPU thread (``--threads``), float32. It takes 10 to 20
minutes (the shipped file: 19.5 minutes on a CPU machine shared with other work). The file
records the settings, the environment (torch, Triton), the date and the wall time of each part.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "llmu" / "data" / "training_runs.json"
SFT_HELDOUT = 4        # the last examples of sft_examples.json: never trained on
DPO_HELDOUT = 6        # the last pairs of preference_pairs.json


def main(argv=None) -> None:
    import llmu  # noqa: F401  (runtime setup first)
    from llmu.models import load_model, load_tokenizer
    from llmu.runtime import environment
    from llmu.training.dpo import preference_pairs
    from llmu.training.lora import add_lora, parameter_counts, unload_lora
    from llmu.training.runs import ALL_PROJECTIONS, dpo_lora, greedy_answers, preference_eval, pretrain_small, sft_lora
    from llmu.training.sft import sft_examples

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file to write (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (default: %(default)s)")
    parser.add_argument("--pretrain-steps", type=int, default=1200)
    parser.add_argument("--sft-steps", type=int, default=48)
    parser.add_argument("--dpo-steps", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens of each greedy answer")
    args = parser.parse_args(argv)
    if min(args.threads, args.pretrain_steps, args.sft_steps, args.dpo_steps, args.new_tokens) < 1:
        parser.error("--threads, the step counts and --new-tokens must be positive")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    settings = {
        "pretrain": dict(hidden=128, layers=2, seq_len=64, batch_size=8, peak_lr=3e-3, warmup=10, text="essays",
                         heldout=0.1, eval_every=25),
        "lora": dict(targets=list(ALL_PROJECTIONS), r=8, alpha=16),
        "sft": dict(batch_size=6, micro_batch=2, lr=1e-3, warmup=4, clip_norm=1.0),
        "dpo": dict(batch_pairs=4, micro_pairs=2, beta=0.1, lr=5e-4, warmup=2, clip_norm=1.0),
    }
    record = {"description": __doc__.split("\n\n")[0], "date": time.strftime("%Y-%m-%d"),
              "environment": environment().as_dict(), "threads": args.threads, "seed": args.seed,
              "settings": settings}
    started = time.perf_counter()

    def log(part):
        def show(row):
            if row["step"] == 1 or row["step"] % 10 == 0:
                print(f"{part} step {row['step']}: loss {row['loss']:.4f} ({row['seconds']:.2f} s)", flush=True)
        return show

    # -- 1. pretraining a small byte-level model
    _, pretrain = pretrain_small(args.pretrain_steps, seed=args.seed, callback=log("pretrain"),
                                 **settings["pretrain"])
    record["pretrain"] = pretrain

    # -- 2. SFT of SmolLM2 with LoRA
    examples = sft_examples()
    train_examples, heldout = examples[:-SFT_HELDOUT], examples[-SFT_HELDOUT:]
    instructions = [ex["instruction"] for ex in heldout]
    model, tokenizer = load_model(fresh=True), load_tokenizer()
    t0 = time.perf_counter()
    answers_before = greedy_answers(model, tokenizer, instructions, args.new_tokens)
    add_lora(model, seed=args.seed, **settings["lora"])
    counts = parameter_counts(model)
    sft_logs = sft_lora(model, tokenizer, train_examples, args.sft_steps, seed=args.seed, callback=log("sft"),
                        **settings["sft"])
    answers_after = greedy_answers(model, tokenizer, instructions, args.new_tokens)
    record["sft"] = {"steps": sft_logs, "n_train": len(train_examples), "trainable": counts.trainable,
                     "total": counts.total,
                     "heldout": [{"instruction": ex["instruction"], "reference": ex["answer"], "before": b, "after": a}
                                 for ex, b, a in zip(heldout, answers_before, answers_after)],
                     "seconds": time.perf_counter() - t0}

    # -- 3. DPO from the SFT model: merge the SFT adapters, add fresh ones
    pairs = preference_pairs()
    train_pairs, test_pairs = pairs[:-DPO_HELDOUT], pairs[-DPO_HELDOUT:]
    t0 = time.perf_counter()
    unload_lora(model)
    add_lora(model, seed=args.seed + 1, **settings["lora"])
    beta = settings["dpo"]["beta"]
    eval_before = preference_eval(model, tokenizer, test_pairs, beta=beta)
    dpo_logs = dpo_lora(model, tokenizer, train_pairs, args.dpo_steps, seed=args.seed, callback=log("dpo"),
                        **settings["dpo"])
    record["dpo"] = {"steps": dpo_logs, "n_train": len(train_pairs),
                     "heldout_before": eval_before,
                     "heldout_after": preference_eval(model, tokenizer, test_pairs, beta=beta),
                     "answers_after": greedy_answers(model, tokenizer, instructions, args.new_tokens),
                     "seconds": time.perf_counter() - t0}
    record["seconds"] = time.perf_counter() - started

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} in {record['seconds']:.0f} s")


if __name__ == "__main__":
    main()
