"""Acceptance and speed of speculative decoding on SmolLM2-135M-Instruct, per prompt, draft, gamma and temperature.

    python benchmarks/spec_acceptance.py                  # writes llmu/data/spec_acceptance.json
    python benchmarks/spec_acceptance.py --resume         # adds the rows the file lacks
    python benchmarks/spec_acceptance.py --out t.json --prompts edit --drafts ngram --gammas 2 4

For each prompt of ``llmu.spec.prompts`` (``edit``, ``summarise``, ``story``), each temperature
(0 = greedy, 0.7, 1.0; seed 0; top-k, top-p and min-p off) and each draft (``ngram``: prompt
lookup, n = 3..1; ``exit4``, ``exit8``, ``exit15``: the target's first 4, 8 or 15 of 30 blocks
with its norm and LM head), one generation of at most 96 new tokens (``--new``) that stops after
the end-of-turn token, through ``llmu.spec.decode.speculative_generate``, for each ``gamma``. A
row records what the module's formula ``(1 - a^(g+1)) / (1 - a)`` needs and what it costs:

- ``acceptance`` = ``accepted / proposed`` (proposals accepted over proposals made, both counts
  kept), ``tokens_per_step`` = ``emitted / steps``;
- ``seconds`` (the generation's wall clock), ``draft_s`` and ``target_s`` (drafting; verifying
  and accepting), and ``plain_seconds`` / ``plain_tokens``: plain decoding (the same loop with
  ``gamma = 0``) of the same prompt, temperature and seed, run right before the draft's ``gamma``
  sweep (under a minute before the row), so that ``speedup`` = the row's tokens/s over plain
  decoding's is a side-by-side ratio on a machine whose load changes;
- greedy rows: ``identical``, whether the tokens are plain greedy decoding's. They must be: the
  script stops with ``OutputMismatch`` before writing a row that is not. Sampled rows have
  ``identical: null`` (their tokens are the target's samples in distribution, not one for one).

Rows are written to the JSON file after every row: an interrupted run keeps what it measured,
and ``--resume`` computes only the rows the file lacks (a file made with other settings, say
another ``--new``, is refused).

**The grid is cut for early exit**: ``gamma`` in (1, 2, 4, 6, 8) for prompt lookup, in (1, 2)
only for the early exits (``--exit-gammas``). An early exit proposal costs ``k`` blocks plus
the LM head (17 to 41 ms here, against about 64 ms for a step of plain decoding) and SmolLM2
accepts few of them (0.005 to 0.16 in every row, at every temperature), so a step emits about
one token whatever ``gamma`` is and each further proposal only adds its cost: a row at
``gamma = 4`` to 8 would take 20 to 30 s and say nothing that ``gamma = 1, 2`` do not. With
every early exit at five gammas the table would take about 50 minutes on one thread; as
shipped it took 18 (99 rows, 2026-11-30).

Timings are on one CPU thread (``--threads``, default 1), float32, on a CPU machine shared with
other work: read ``speedup`` (a ratio measured side by side), not the seconds. A sampled row is
one generation with one seed: its acceptance is that of one text, and rows of the same prompt
and temperature differ by more than their ``gamma`` explains.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "llmu" / "data" / "spec_acceptance.json"
PROMPTS = ("edit", "summarise", "story")
DRAFTS = ("ngram", "exit4", "exit8", "exit15")
GAMMAS = (1, 2, 4, 6, 8)
EXIT_GAMMAS = (1, 2)
TEMPERATURES = (0.0, 0.7, 1.0)
MODEL = "SmolLM2-135M-Instruct"
#: The settings a resumed file must share with the command line.
SETTINGS = ("model", "dtype", "max_new_tokens", "seed", "sampling")


def plan(prompts, drafts, gammas, exit_gammas, temperatures) -> list[tuple[float, str, str, list[int]]]:
    """Sweeps in order: temperature (greedy first), prompt, draft; each ``(temperature, prompt,
    draft, gammas)`` is one plain decoding followed by one generation per gamma."""
    return [(float(t), p, d, list(exit_gammas if d.startswith("exit") else gammas))
            for t in temperatures for p in prompts for d in drafts]


def row_key(row) -> tuple:
    return row["prompt"], row["draft"], row["gamma"], float(row["temperature"])


def main(argv=None) -> None:
    import llmu  # noqa: F401  (runtime setup first)
    from llmu.bench.results import resumable
    from llmu.models import load_model, load_tokenizer
    from llmu.models.sampling import SamplingParams
    from llmu.runtime import environment
    from llmu.spec.bench import check_identical, make_draft
    from llmu.spec.decode import speculative_generate
    from llmu.spec.drafts import NGramDraft
    from llmu.spec.prompts import end_token, prompt_ids

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON file to write (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in --out; compute the others")
    parser.add_argument("--prompts", nargs="+", default=list(PROMPTS), choices=PROMPTS)
    parser.add_argument("--drafts", nargs="+", default=list(DRAFTS), help="ngram and/or exit<k> (k of 30 blocks)")
    parser.add_argument("--gammas", nargs="+", type=int, default=list(GAMMAS), help="gammas of prompt lookup")
    parser.add_argument("--exit-gammas", nargs="+", type=int, default=list(EXIT_GAMMAS),
                        help="gammas of the early exit drafts")
    parser.add_argument("--temperatures", nargs="+", type=float, default=list(TEMPERATURES))
    parser.add_argument("--new", type=int, default=96, help="new tokens at most (the end-of-turn token stops earlier)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of every generation")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    args = parser.parse_args(argv)
    if any(g < 1 for g in args.gammas + args.exit_gammas) or args.new < 1 or args.threads < 1:
        parser.error("gammas, --new and --threads must be positive")
    torch.set_num_threads(args.threads)

    model = load_model(dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer()
    drafts = {key: make_draft(model, key) for key in args.drafts}  # a bad key fails before anything runs
    eos = end_token(tokenizer)
    settings = dict(model=MODEL, dtype="float32", max_new_tokens=args.new, seed=args.seed,
                    sampling=dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0))
    grid = dict(prompts=args.prompts, temperatures=args.temperatures,
                drafts={key: d.name for key, d in drafts.items()},
                gammas={key: args.exit_gammas if key.startswith("exit") else args.gammas for key in drafts})
    out = Path(args.out)
    record = resumable(out, settings, SETTINGS) if args.resume else None
    if record is not None:
        record.update(grid=grid, threads=args.threads, date=time.strftime("%Y-%m-%d"))
    else:
        record = dict(
            what="speculative decoding of SmolLM2-135M-Instruct on the prompts of llmu.spec.prompts: acceptance, "
                 "tokens per step and speed-up over plain decoding, per draft, gamma and temperature",
            **settings, eos_token_id=eos, device="cpu", threads=args.threads, grid=grid,
            made_by=" ".join(["python benchmarks/spec_acceptance.py", *(argv if argv is not None else sys.argv[1:])]),
            environment=str(environment()), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
            run_seconds=0.0, rows=[],
        )
    done = {row_key(r) for r in record["rows"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")

    def generate(ids, draft, gamma, temperature):
        params = SamplingParams(temperature=temperature, seed=args.seed)
        return speculative_generate(model, draft, ids, args.new, gamma=gamma, params=params, eos_token_id=eos)

    ids_of = {p: prompt_ids(tokenizer, p) for p in args.prompts}
    generate(ids_of[args.prompts[0]], NGramDraft(), 0, 0.0)  # warm-up: first calls allocate
    for temperature, prompt, key, gammas in plan(args.prompts, args.drafts, args.gammas, args.exit_gammas,
                                                 args.temperatures):
        todo = [g for g in gammas if (prompt, key, g, temperature) not in done]
        if not todo:
            continue
        ids = ids_of[prompt]
        plain = generate(ids, NGramDraft(), 0, temperature)
        for gamma in todo:
            start = time.perf_counter()
            spec = generate(ids, drafts[key], gamma, temperature)
            s = spec.stats
            identical = None
            if temperature == 0:
                check_identical(plain.tokens, spec.tokens, f"{prompt}, {key}, gamma {gamma}")
                identical = True
            proposed, accepted, emitted = sum(s.proposed), sum(s.accepted), len(spec.tokens)
            plain_tps = len(plain.tokens) / plain.stats.total_s
            row = dict(
                prompt=prompt, draft=key, draft_label=drafts[key].name, gamma=gamma, temperature=temperature,
                acceptance=accepted / proposed if proposed else None, tokens_per_step=emitted / s.steps,
                accepted=accepted, proposed=proposed, steps=s.steps, emitted=emitted,
                ended=bool(spec.tokens) and spec.tokens[-1] == eos,
                seconds=round(s.total_s, 4), draft_s=round(s.draft_s, 4), target_s=round(s.target_s, 4),
                plain_seconds=round(plain.stats.total_s, 4), plain_tokens=len(plain.tokens),
                speedup=(emitted / s.total_s) / plain_tps, identical=identical,
            )
            record["rows"].append(row)
            record["run_seconds"] = round(record["run_seconds"] + time.perf_counter() - start
                                          + (plain.stats.total_s if gamma == todo[0] else 0), 1)
            acc = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "  - "
            print(f"T={temperature:<4g} {prompt:9s} {key:6s} gamma {gamma}: acceptance {acc}  "
                  f"{row['tokens_per_step']:.2f} tokens/step  speedup {row['speedup']:.2f}x  "
                  f"({row['seconds']:.1f} s, plain {row['plain_seconds']:.1f} s; total {record['run_seconds']:.0f} s)",
                  flush=True)
            out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
