"""Ring attention (llmu.parallel.context_parallel) on real gloo processes.

The oracle is full attention on the whole sequence, on every rank: llmu's reference
(``llmu.attention.reference.attention``, differentiated by autograd) for the output and the
gradients, PyTorch's ``scaled_dot_product_attention`` as a second opinion on the output, and
``logsumexp`` of the explicit score matrix for ``lse``. Each rank keeps its shard of the sequence
(``shard_sequence``, contiguous or zigzag), runs ring attention with the loss ``<out, d_out>`` and
reports the largest relative differences on its rows (``dk``, ``dv`` on its own keys: they come
home after the ring's second turn).

Spawning a process group costs seconds, so each world size runs every case inside ONE ``launch``.

Tolerance, float32, relative to ``max(|reference|, 1)``: ``1e-5``. Ring attention computes the
same scores and exponentials as full attention but sums the softmax over key blocks in another
order (one block per ring step, merged through ``lse``), and ``dk``/``dv`` add the ranks'
contributions in ring order: a few float32 roundings per entry. The largest error seen over all
cases is ``7e-7``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import llmu  # noqa: F401  (sets the Triton mode before anything imports triton)
from llmu.attention.reference import attention, repeat_kv
from llmu.distributed import launch
from llmu.flash.reference import flash_attention
from llmu.parallel import context_parallel as CP

RTOL = 1e-5


def _case(causal, layout, heads=4, kv_heads=2, batch=2, seq_per_rank=8, head_dim=8, seed=0):
    return dict(causal=causal, layout=layout, heads=heads, kv_heads=kv_heads, batch=batch,
                seq_per_rank=seq_per_rank, head_dim=head_dim, seed=seed)


CASES = {
    "causal_contiguous_gqa": _case(True, "contiguous"),
    "causal_zigzag_gqa": _case(True, "zigzag", seed=1),
    "full_contiguous_mha": _case(False, "contiguous", heads=3, kv_heads=3, seed=2),
    "full_zigzag_mqa": _case(False, "zigzag", kv_heads=1, batch=1, seed=3),
    "causal_zigzag_long": _case(True, "zigzag", heads=2, kv_heads=1, batch=1, seq_per_rank=40, head_dim=16,
                                seed=4),   # chunks longer than flash_attention's 64-row tiles at W=4
}


def _rel(a, b):
    return ((a - b).abs().max() / max(b.abs().max().item(), 1.0)).item()


def _run_case(rank, world, case):
    seq = case["seq_per_rank"] * world
    g = torch.Generator().manual_seed(case["seed"])
    q_all = torch.randn(case["batch"], case["heads"], seq, case["head_dim"], generator=g)
    k_all = torch.randn(case["batch"], case["kv_heads"], seq, case["head_dim"], generator=g)
    v_all = torch.randn(k_all.shape, generator=g)
    d_out_all = torch.randn(q_all.shape, generator=g)
    causal, layout = case["causal"], case["layout"]

    # full attention on the whole sequence: output, gradients, and lse from the explicit scores
    full = [t.clone().requires_grad_() for t in (q_all, k_all, v_all)]
    out_ref = attention(*full, causal=causal)
    (out_ref * d_out_all).sum().backward()
    rep = case["heads"] // case["kv_heads"]
    out_sdpa = F.scaled_dot_product_attention(q_all, repeat_kv(k_all, rep), repeat_kv(v_all, rep), is_causal=causal)
    scores = q_all @ repeat_kv(k_all, rep).transpose(-1, -2) / math.sqrt(case["head_dim"])
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    lse_ref = torch.logsumexp(scores, dim=-1)

    # this rank's shard through the ring
    mine = lambda t: CP.shard_sequence(t, world, rank, layout=layout)   # noqa: E731
    q, k, v = (mine(t).requires_grad_() for t in (q_all, k_all, v_all))
    out, lse = CP.ring_attention(q, k, v, causal=causal, layout=layout)
    (out * mine(d_out_all)).sum().backward()
    return {
        "out": _rel(out, mine(out_ref.detach())), "out_sdpa": _rel(out, mine(out_sdpa)),
        "lse": _rel(lse[..., None], mine(lse_ref[..., None])),
        "dq": _rel(q.grad, mine(full[0].grad)), "dk": _rel(k.grad, mine(full[1].grad)),
        "dv": _rel(v.grad, mine(full[2].grad)),
    }


def _refusals(rank, world):
    """Errors every rank raises together (so that no rank waits for a peer that gave up)."""
    messages = {}
    cases = {
        # rank 0 holds one more token than the others: caught by the shape exchange, on every rank
        "uneven": lambda: CP.ring_attention(*(torch.randn(1, 2, 8 + (rank == 0), 4) for _ in range(3))),
        "odd_zigzag": lambda: CP.ring_attention(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4),
                                                torch.randn(1, 2, 5, 4), layout="zigzag"),
        "q_k_lengths": lambda: CP.ring_attention(torch.randn(1, 2, 4, 4), torch.randn(1, 2, 6, 4),
                                                 torch.randn(1, 2, 6, 4)),
    }
    for name, run in cases.items():
        try:
            run()
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


def _run_all(rank, world):
    return {**{name: _run_case(rank, world, case) for name, case in CASES.items()},
            "refusals": _refusals(rank, world), "demo": CP.demo(rank, world, 32)}


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_full_attention(world):
    """Every case of one world size in one launch: forward, lse, backward; refusals; the demo."""
    results = launch(_run_all, world)
    problems = []
    for rank, got in enumerate(results):
        for name in CASES:
            errors = got[name]
            if not all(e <= RTOL for e in errors.values()):
                problems.append(f"rank {rank}, {name}: relative errors {errors} above {RTOL}")
        demo = got["demo"]
        if max(demo[key] for key in ("out", "lse", "dq", "dk", "dv")) > 1e-5:   # absolute, |values| ~ 1
            problems.append(f"rank {rank}, demo: {demo}")
        if [step["kv_rank"] for step in demo["schedule"]] != [(rank - s) % world for s in range(world)]:
            problems.append(f"rank {rank}, demo: schedule {demo['schedule']}")
        # the demo's K/V shard: batch 1, 2 KV heads, 32/W tokens, head_dim 16, float32
        kv_bytes = 1 * 2 * (32 // world) * 16 * 4
        sent = {"forward": 2 * (world - 1), "backward": 2 * (world - 1) + 2 * world}   # k, v; then k, v, dk, dv
        if demo["sends"] != sent or demo["sent_bytes"] != {p: n * kv_bytes for p, n in sent.items()}:
            problems.append(f"rank {rank}, demo: sent {demo['sends']} tensors, {demo['sent_bytes']} bytes; "
                            f"expected {sent} of {kv_bytes} bytes each")
        refusals = got["refusals"]
        if refusals["uneven"] is None or "every rank must hold a q, k of the same shape" not in refusals["uneven"]:
            problems.append(f"rank {rank}: uneven shards gave {refusals['uneven']!r}")
        if refusals["odd_zigzag"] is None or "must be divisible by 2" not in refusals["odd_zigzag"]:
            problems.append(f"rank {rank}: an odd zigzag shard gave {refusals['odd_zigzag']!r}")
        if refusals["q_k_lengths"] is None or "q and k must hold the same tokens" not in refusals["q_k_lengths"]:
            problems.append(f"rank {rank}: q, k of different lengths gave {refusals['q_k_lengths']!r}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# the layout, the schedule and the merge: no processes needed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", CP.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_and_unshard_round_trip(world, layout):
    x = torch.arange(2 * 3 * 24 * 5, dtype=torch.float32).view(2, 3, 24, 5)
    shards = [CP.shard_sequence(x, world, r, layout=layout) for r in range(world)]
    assert all(s.shape == (2, 3, 24 // world, 5) for s in shards)
    assert torch.equal(CP.unshard_sequence(shards, layout=layout), x)
    positions = torch.cat([CP.local_positions(24, world, r, layout) for r in range(world)])
    assert sorted(positions.tolist()) == list(range(24))


def test_zigzag_positions_and_refusals():
    assert CP.local_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert CP.local_positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert CP.sequence_chunks(4, 1, "zigzag") == [1, 6]
    with pytest.raises(ValueError, match=r"seq_len=10 is not divisible by 4 \(the number of chunks of the 'zigzag'"):
        CP.shard_sequence(torch.randn(1, 1, 10, 2), 2, 0, layout="zigzag")
    with pytest.raises(ValueError, match="seq_len=10 is not divisible by 4"):
        CP.shard_sequence(torch.randn(1, 1, 10, 2), 4, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        CP.sequence_chunks(2, 0, "striped")
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size=2\)"):
        CP.sequence_chunks(2, 2)


@pytest.mark.parametrize("layout", CP.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_schedule_covers_every_pair_once(causal, layout):
    """Over the W steps each rank meets every K/V block once, and the tiles it computes are
    exactly the (query chunk, key chunk) pairs that full (causal) attention needs."""
    world = 4
    schedule = CP.ring_schedule(world, causal=causal, layout=layout)
    for rank, steps in enumerate(schedule):
        assert sorted(s["kv_rank"] for s in steps) == list(range(world))
        q_chunks = CP.sequence_chunks(world, rank, layout)
        for step in steps:
            for q_slot, kv_slot, kind in step["tiles"]:
                qc, kc = q_chunks[q_slot], step["kv_chunks"][kv_slot]
                want = "full" if not causal or kc < qc else ("causal" if kc == qc else "skip")
                assert kind == want
    work = CP.schedule_work(schedule)
    total = sum(map(sum, work))
    assert total == (world * world / 2 if causal else world * world)   # in (T/W)^2 blocks: half the square
    if causal and layout == "contiguous":
        assert [sum(w) for w in work] == [r + 0.5 for r in range(world)]   # the last rank does 7x the first's
    if layout == "zigzag" or not causal:
        assert len({sum(w) for w in work}) == 1                            # balanced


def test_merge_partials_is_attention_over_the_union_of_keys():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    out, lse = flash_attention(q, k, v)
    o1, l1 = flash_attention(q, k[:, :, :2], v[:, :, :2])
    o2, l2 = flash_attention(q, k[:, :, 2:], v[:, :, 2:])
    merged, merged_lse = CP.merge_partials(o1, l1, o2, l2)
    torch.testing.assert_close(merged, out, rtol=0, atol=1e-6)
    torch.testing.assert_close(merged_lse, lse, rtol=0, atol=1e-6)
    # no keys yet (lse = -inf) merges as nothing
    empty = CP.merge_partials(torch.zeros_like(o1), torch.full_like(l1, float("-inf")), o1, l1)
    assert torch.equal(empty[0], o1) and torch.equal(empty[1], l1)
    with pytest.raises(ValueError, match="matching shapes"):
        CP.merge_partials(o1, l1, o2[..., :4], l2)


def test_ring_attention_needs_a_process_group_and_good_inputs():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="needs a process group"):
        CP.ring_attention(q, q, q)
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        CP.ring_attention(torch.randn(1, 3, 4, 8), q, q)
    with pytest.raises(TypeError, match="k must have dtype"):
        CP.ring_attention(q, q.long(), q)
    with pytest.raises(ValueError, match="layout must be one of"):
        CP.ring_attention(q, q, q, layout="striped")
