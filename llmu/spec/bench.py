"""Benchmarks of module 11: does speculative decoding make SmolLM2 faster, and what does the step cost?

``spec_decode`` (a whole-model ``run=`` entry, :func:`compare_spec`): SmolLM2-135M, batch 1,
greedy, one of the prompts of :mod:`llmu.spec.prompts` (size key ``prompt``). Plain decoding
against speculative decoding with each draft: prompt lookup (``NGramDraft``, n = 3..1, ``gamma``
proposals a step) and the target's own first ``exit`` blocks (``EarlyExitDraft``, ``exit_gamma``
proposals a step) and, on a CPU with size key ``int4_gamma``, the target itself at 4 bits
(``QuantizedDraft``, ``int4_gamma`` proposals a step), with the same ``new`` tokens at most and the
same end-of-turn token. Every
generation goes through one loop, ``llmu.spec.decode.speculative_generate``: plain decoding is
that loop with ``gamma = 0``, so the two sides pay the same overheads and differ only in drafting
and verifying. The providers run in turn (plain, then each draft, ``repeats`` rounds after a
two-token warm-up each, :func:`llmu.bench.interleave`: a busy moment on a shared machine hurts all
alike).

Tokens/s counts decoding only, the prompt's prefill subtracted: a sample is one generation of one
token (the prompt's pass and one pick: no proposal fits a budget of one) and one of ``new``,
``decode tokens/s = (tokens - 1) / (t(new) - t(1))``, ``tokens`` the tokens the second one emitted.
The rows carry the median and spread, the paired ratio ``provider_r / plain_r`` of every round
(median, min..max, whether that includes 1; ``speedup`` is the median), and the load average.
Greedy speculative decoding must emit *exactly* plain greedy decoding's tokens: every round's
tokens are compared with the plain run's of that round, and a provider that differs is an error
row (the speed-up of a decoder that changes the output means nothing; :func:`measure_spec`
raises :class:`OutputMismatch`).

What it shows: a step costs one target pass over ``gamma + 1`` tokens, on a GPU about the price
of a pass over one (decoding reads every weight once per pass, module 05), plus the draft's work.
On a CPU the pass is only that cheap if the matrix products of a few rows run at the rate of
memory: with two threads on the course's machine the BLAS took 19.7 ms for the weights' products
of one row and 45.6 ms for seven, and oneDNN, from weights copied once into its own layout
(``llmu.models.decode_step``, ``pack=True``), 26.7 ms for seven. Both sides decode through
``DecodeStep``; a verification pass of ``PACKED_MIN_ROWS`` tokens or more uses the packed copy, made
when the target's cache is built (``setup_s`` in the rows, about 0.4 s, outside the timed
generation like the prefill: a server would make it once per model). Prompt lookup is free, and on the ``edit`` and ``summarise``
prompts (outputs that copy their prompt) its proposals are often right: several tokens a step. On
``story`` it rarely is, and each accidental match costs a wider verification. An early exit
proposes with ``exit`` of 30 blocks *and the whole LM head* (49,152 x 576, a fifth of a target
step) for each proposal, and SmolLM2's intermediate layers are poor predictors of its output: a
few percent of the proposals are accepted, so it slows decoding down. The 4-bit draft is the
opposite case: accepted nearly always (0.95-1.0 on ``edit``), and too dear to pay on two cores
(0.6 of a step a proposal, :mod:`llmu.spec.quantized_step`): about 0.9-1.0x.

Rows (``provider``): ``plain``, ``n-gram``, ``early exit <k>``, ``4-bit draft``; ``tokens_per_s`` and ``ms`` (per
decoded token, the prefill left out), ``speedup`` and ``ratio`` (over plain's, paired),
``acceptance`` (accepted proposals over proposals made), ``tokens_per_step``, ``gamma``,
``draft_share`` (the draft's seconds over the generation's), ``tokens`` and ``steps``,
``packed_weights`` and ``setup_s``. The model
runs in float32 on a GPU too: the comparison of tokens needs plain decoding (one token a pass)
and verification (``gamma + 1`` a pass) to agree on every argmax, and the two passes' matmuls
have different shapes, hence different roundings: in bfloat16 that can flip a near-tie (float32
makes that rare enough to check every token).

``spec_accept_reject`` (a kernel entry): one accept/reject step of speculative *sampling* for a
batch of ``B`` sequences, ``gamma`` proposals each, a vocabulary of ``V`` (SmolLM2's 49,152 on a
GPU): the Triton kernel ``llmu.spec.kernels.accept_reject`` against the torch reference
``llmu.spec.reference.accept_reject``. Per call, counted per sequence (elem = bytes per
probability)::

    flops = B * (2 * gamma              the accept test u * q(x) < p(x): a multiply, a compare
                 + 2 * 3 * V)           two passes over the row after the prefix: p - q,
                                        max(0, .), a running sum (the nominal count: the bonus
                                        case skips the subtraction)
    bytes = B * (2 * gamma * elem       p_i(x_i) and q_i(x_i) of the accept test
                 + 2 * V * elem         the rows at the first rejection, p and q (the bonus reads
                                        p[gamma] alone: the worst case is counted; the second pass
                                        re-reads them, mostly from L2, not counted)
                 + gamma * (8 + 4)      draft ids (int64) and u (float32)
                 + 4 + 2 * 8)           r (float32); accepted and next token written (int64)

Not the whole of ``p`` ``(B, gamma + 1, V)`` and ``q`` ``(B, gamma, V)``: neither implementation
reads more than the rows above (the kernel's napkin math, :mod:`llmu.spec.kernels`). The inputs
are what a step sees: ``p`` the softmax of random logits, ``q`` that of the same logits plus noise
(a draft that agrees with the target only in part), the proposals drawn from ``q``. Both
providers run with ``check_values=False``: the check of the values reads all of ``p`` and ``q``
and waits for the GPU, which is part of a call's cost but not of the step measured here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from llmu.bench.paired import Paired, interleave
from llmu.bench.registry import Entry, Provider, register
from llmu.spec import kernels, reference
from llmu.spec.decode import SpecOutput, speculative_generate
from llmu.spec.drafts import Draft, EarlyExitDraft, NGramDraft, QuantizedDraft
from llmu.spec.quantized_step import quantized_unavailable

__all__ = ["SPEC_DECODE", "SPEC_ACCEPT_REJECT", "OutputMismatch", "check_identical", "make_draft",
           "draft_key", "compare_spec", "measure_spec", "accept_reject_setup", "accept_reject_triton", "accept_reject_torch",
           "accept_reject_flops", "accept_reject_bytes"]

MODULE = "11_speculative_decoding"
PLAIN = "plain"


class OutputMismatch(RuntimeError):
    """Greedy speculative decoding emitted other tokens than plain greedy decoding."""


def _difference(expected: Sequence[int], got: Sequence[int]) -> str | None:
    """Where greedy speculative decoding's tokens ``got`` part from plain decoding's ``expected``."""
    expected, got = [int(t) for t in expected], [int(t) for t in got]
    if got == expected:
        return None
    i = next((j for j, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    return (f"greedy speculative decoding differs from plain greedy decoding at token {i} "
            f"({len(got)} tokens against {len(expected)}; "
            f"{got[i] if i < len(got) else 'end'} instead of {expected[i] if i < len(expected) else 'end'})")


def check_identical(expected: Sequence[int], got: Sequence[int], what: str) -> None:
    """Raise :class:`OutputMismatch` unless ``got`` (speculative, greedy) equals ``expected`` (plain)."""
    why = _difference(expected, got)
    if why:
        raise OutputMismatch(f"{what}: {why}")


def make_draft(model, key: str) -> Draft:
    """The draft named ``key``: ``"ngram"`` (prompt lookup, n = 3..1), ``"exit<k>"`` (the first
    ``k`` blocks of ``model``, its norm and LM head) or ``"int4"`` (``model`` itself at 4 bits,
    groups of 32, its LM head at 8: :class:`~llmu.spec.drafts.QuantizedDraft`, CPU only)."""
    if key == "ngram":
        return NGramDraft(3, 1)
    if key == "int4":
        return QuantizedDraft(model, 32)
    m = re.fullmatch(r"exit(\d+)", key) if isinstance(key, str) else None
    if m is None:
        raise ValueError(f"draft must be 'ngram', 'int4' or 'exit<k>' (k blocks, e.g. 'exit4'), got {key!r}")
    return EarlyExitDraft(model, int(m.group(1)))


def draft_key(draft: Draft) -> str:
    """The key :func:`make_draft` builds ``draft`` from."""
    if isinstance(draft, EarlyExitDraft):
        return f"exit{draft.num_layers}"
    if isinstance(draft, QuantizedDraft) and draft.group_size == 32:
        return "int4"
    if isinstance(draft, NGramDraft) and (draft.max_ngram, draft.min_ngram) == (3, 1):
        return "ngram"
    raise ValueError(f"no key for draft {draft.name!r}")


# ----------------------------------------------------------------------------------------------
# spec_decode: plain against speculative decoding, whole model
# ----------------------------------------------------------------------------------------------


def compare_spec(model, prompt: Sequence[int], runs: Mapping[str, tuple[Draft, int]], max_new_tokens: int, *,
                 eos_token_id: int | None = None, repeats: int = 3) -> Paired:
    """Greedy plain decoding and greedy speculative decoding with each ``runs[name] = (draft, gamma)``,
    in turn, ``repeats`` rounds, after a warm-up of two tokens each (see the module's docstring).

    Figures of each call: ``decode_tokens_per_s`` (the default one; the prefill subtracted),
    ``seconds``, ``draft_s`` and ``target_s`` (of the generation of ``max_new_tokens``); output:
    its tokens, compared with plain's of the same round; ``info``: ``tokens``, ``steps``,
    ``gamma``, ``acceptance`` (``None`` without proposals) and ``tokens_per_step``. The plain run
    is ``"plain"``, the base of the ratios.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if PLAIN in runs:
        raise ValueError(f"{PLAIN!r} is the name of the plain run; name the drafts otherwise")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be an int >= 2 to time decoding, got {max_new_tokens!r}")
    everything = {PLAIN: (NGramDraft(), 0), **runs}  # gamma 0: the draft is never asked

    def generate(draft, gamma, n) -> SpecOutput:
        return speculative_generate(model, draft, prompt, n, gamma=gamma, eos_token_id=eos_token_id)

    for draft, gamma in everything.values():  # first calls allocate
        generate(draft, gamma, 2)

    def call(name: str, draft: Draft, gamma: int):
        def one_round() -> dict:
            one = generate(draft, gamma, 1)  # the prompt's pass and one pick: what is subtracted
            out = generate(draft, gamma, max_new_tokens)
            s = out.stats
            if len(out.tokens) < 2:
                raise ValueError(f"{name}: the generation ended after {len(out.tokens)} token: no decoding to time")
            decode_s = max(s.total_s - one.stats.total_s, 1e-9)
            return {"decode_tokens_per_s": (len(out.tokens) - 1) / decode_s, "seconds": s.total_s,
                    "draft_s": s.draft_s, "target_s": s.target_s, "output": out.tokens,
                    "info": dict(tokens=len(out.tokens), steps=s.steps, gamma=gamma, tokens_per_step=s.tokens_per_step,
                                 packed=s.packed, setup_s=s.setup_s,
                                 acceptance=None if gamma == 0 or not sum(s.proposed) else s.acceptance_rate)}
        return one_round

    labels = {name: f"{name} ({draft.name}, gamma {gamma})" for name, (draft, gamma) in everything.items()}
    paired = interleave({name: call(name, d, g) for name, (d, g) in everything.items()}, repeats, warmup=0,
                        base=PLAIN, figure="decode_tokens_per_s", check=True, reference=PLAIN, compare=_difference)
    for name in list(paired.mismatches):
        paired.mismatches[name] = f"{labels[name]}: {paired.mismatches[name]}"
    return paired


def measure_spec(model, prompt: Sequence[int], runs: Mapping[str, tuple[Draft, int]], max_new_tokens: int, *,
                 eos_token_id: int | None = None, repeats: int = 3) -> dict[str, dict]:
    """:func:`compare_spec` as one dict per run: ``tokens``, ``steps``, ``gamma``, ``acceptance``,
    ``tokens_per_step``; ``seconds``, ``draft_s``, ``target_s`` and ``decode_tokens_per_s``
    (medians); ``speedup`` (the median paired ratio over plain's). Raises :class:`OutputMismatch`
    when a speculative run emitted other tokens than plain decoding."""
    paired = compare_spec(model, prompt, runs, max_new_tokens, eos_token_id=eos_token_id, repeats=repeats)
    if paired.mismatches:
        raise OutputMismatch("; ".join(paired.mismatches.values()))
    result = {}
    for name in paired.names:
        ratio = paired.ratio(name)
        result[name] = dict(**paired.info[name][-1],  # greedy: every round makes the same steps
                            seconds=paired.stats(name, "seconds")["median"],
                            draft_s=paired.stats(name, "draft_s")["median"],
                            target_s=paired.stats(name, "target_s")["median"],
                            decode_tokens_per_s=paired.stats(name)["median"],
                            speedup=1.0 if ratio is None else ratio["median"])
    return result


def _run(size: dict, device) -> list[dict]:
    from llmu.models import load_model, load_tokenizer
    from llmu.spec.prompts import end_token, prompt_ids

    model = load_model(dtype=torch.float32, device=device)
    tokenizer = load_tokenizer()
    gamma, exit_layers = size.get("gamma", 6), size.get("exit", 4)
    runs = {"n-gram": (make_draft(model, "ngram"), gamma),
            f"early exit {exit_layers}": (make_draft(model, f"exit{exit_layers}"), size.get("exit_gamma", 2))}
    if "int4_gamma" in size and torch.device(device).type == "cpu" and quantized_unavailable() is None:
        runs["4-bit draft"] = (make_draft(model, "int4"), size["int4_gamma"])
    paired = compare_spec(model, prompt_ids(tokenizer, size.get("prompt", "edit")), runs, size.get("new", 96),
                          eos_token_id=end_token(tokenizer), repeats=size.get("repeats", 3))
    rows = []
    for name in paired.names:
        info = paired.info[name][-1]
        fields = paired.row_fields(name, key="tokens_per_s")
        label = ("plain decoding (gamma = 0)" if name == PLAIN
                 else f"{runs[name][0].name}, gamma = {info['gamma']}")
        rows.append(dict(
            provider=name, label=label, kind="torch", phase="decode", **fields, acceptance=info["acceptance"],
            tokens_per_step=info["tokens_per_step"], gamma=info["gamma"],
            draft_share=paired.stats(name, "draft_s")["median"] / paired.stats(name, "seconds")["median"],
            tokens=info["tokens"], steps=info["steps"], dtype=torch.float32,
            packed_weights=info["packed"], setup_s=info["setup_s"],
        ))
    return rows


SPEC_DECODE = register(
    Entry(
        name="spec_decode",
        module=MODULE,
        description="SmolLM2-135M greedy decode tokens/s (prefill subtracted) on a prompt of llmu.spec.prompts: "
                    "plain vs speculative with n-gram lookup, an early exit draft and (CPU) the model at 4 bits, in turn (paired speedup, "
                    "identical output enforced)",
        run=_run,
        gpu_sizes=[{"prompt": p, "new": 128, "gamma": 6, "exit": 8, "exit_gamma": 2, "repeats": 5}
                   for p in ("edit", "summarise", "story")],
        cpu_sizes=[{"prompt": "edit", "new": 96, "gamma": 6, "exit": 4, "exit_gamma": 2, "int4_gamma": 2, "repeats": 3}],
        gpu_dtype=torch.float32,
        x_axis="prompt",
    )
)


# ----------------------------------------------------------------------------------------------
# spec_accept_reject: the Triton step against the torch reference
# ----------------------------------------------------------------------------------------------


def accept_reject_setup(size, device, dtype):
    """``(p, q, draft, u, r)`` for ``B`` sequences, ``gamma`` proposals, ``V`` tokens (seeded)."""
    b, gamma, v = size["B"], size["gamma"], size["V"]
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(b, gamma + 1, v, generator=g, device="cpu") * 3
    p = logits.softmax(-1)
    q = (logits[:, :gamma] + torch.randn(b, gamma, v, generator=g, device="cpu")).softmax(-1)
    draft = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(b, gamma)
    u = torch.rand(b, gamma, generator=g, device="cpu")
    r = torch.rand(b, generator=g, device="cpu")
    return (p.to(device=device, dtype=dtype), q.to(device=device, dtype=dtype), draft.to(device),
            u.to(device), r.to(device))


def accept_reject_triton(p, q, draft, u, r):
    # the inputs are valid by construction: time the step alone, without the pass over p and q
    # that checks their values (and the wait for the GPU that reading the result back costs)
    return kernels.accept_reject(p, q, draft, u, r, check_values=False)


def accept_reject_torch(p, q, draft, u, r):
    return reference.accept_reject(p, q, draft, u, r, check_values=False)


def accept_reject_flops(size) -> float:
    return float(size["B"] * (2 * size["gamma"] + 2 * 3 * size["V"]))


def accept_reject_bytes(size, elem: int) -> float:
    b, gamma, v = size["B"], size["gamma"], size["V"]
    return float(b * (2 * gamma * elem + 2 * v * elem + gamma * (8 + 4) + 4 + 2 * 8))


SPEC_ACCEPT_REJECT = register(
    Entry(
        name="spec_accept_reject",
        module=MODULE,
        description="one accept/reject step of speculative sampling for a batch (B sequences, gamma proposals, "
                    "V tokens): the fused Triton kernel vs the torch reference",
        providers={
            "llmu triton": Provider(accept_reject_triton, "triton", "llmu Triton accept/reject (one launch)"),
            "llmu torch": Provider(accept_reject_torch, "torch", "llmu torch reference (vectorised)"),
        },
        setup=accept_reject_setup,
        flops=accept_reject_flops,
        bytes=accept_reject_bytes,
        gpu_sizes=[{"B": b, "gamma": 4, "V": 49152} for b in (1, 8, 32, 128)],
        cpu_sizes=[{"B": b, "gamma": 4, "V": 4096} for b in (1, 8)],
        x_axis="B",
    )
)
