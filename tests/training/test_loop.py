"""The training loop (llmu.training.loop): schedule, accumulation, clipping, AdamW state, exact resume.

Every test trains a byte-level Llama of about 140k parameters (hidden 64, two layers) on 32-byte
windows of the shipped essays: a step takes about 10 ms on one CPU thread.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from llmu.models import byte_llama_config, make_trainable, tiny_llama
from llmu.training.loop import (
    OptimizerMemory,
    StepLog,
    TokenWindows,
    TrainConfig,
    Trainer,
    adamw_param_groups,
    adamw_state_bytes,
    clip_grad_norm,
    optimizer_state_memory,
    warmup_cosine,
    warmup_cosine_scheduler,
)

SEQ = 32
CONFIG = byte_llama_config(64, 2, max_len=64, head_dim=16)


pytestmark = pytest.mark.usefixtures("one_thread")    # tests/training/conftest.py


def make_trainer(model_seed: int = 0, data_seed: int = 0, **config) -> Trainer:
    settings = dict(total_steps=20, batch_size=4, warmup=2, peak_lr=1e-2, min_lr=1e-3) | config
    return Trainer(make_trainable(CONFIG, seed=model_seed), TokenWindows.from_text("essays", SEQ, data_seed),
                   TrainConfig(**settings))


# ----------------------------------------------------------------------------------------------
# Schedule
# ----------------------------------------------------------------------------------------------

def test_warmup_is_linear_up_to_the_peak():
    peak, warmup = 3e-3, 10
    for step in range(warmup):
        assert warmup_cosine(step, warmup, 100, peak, 3e-4) == pytest.approx(peak * (step + 1) / warmup, rel=1e-12)
    assert warmup_cosine(warmup - 1, warmup, 100, peak, 3e-4) == pytest.approx(peak, rel=1e-12)


def test_cosine_halfway_and_end():
    peak, low, warmup, total = 1.0, 0.1, 10, 110
    assert warmup_cosine(warmup, warmup, total, peak, low) == pytest.approx(peak, rel=1e-12)
    assert warmup_cosine(warmup + 50, warmup, total, peak, low) == pytest.approx((peak + low) / 2, rel=1e-12)
    quarter = low + (peak - low) * 0.5 * (1 + math.cos(math.pi / 4))
    assert warmup_cosine(warmup + 25, warmup, total, peak, low) == pytest.approx(quarter, rel=1e-12)
    assert warmup_cosine(total, warmup, total, peak, low) == pytest.approx(low, rel=1e-12)
    assert warmup_cosine(total + 7, warmup, total, peak, low) == low  # past the plan: stays at min_lr
    assert warmup_cosine(0, 0, total, peak, low) == peak              # no warmup: starts at the peak


def test_schedule_rises_then_falls():
    lrs = [warmup_cosine(s, 20, 200, 1e-3, 1e-5) for s in range(220)]
    rising, falling = lrs[:20], lrs[20:]
    assert all(a < b for a, b in zip(rising, rising[1:]))
    assert all(a >= b for a, b in zip(falling, falling[1:]))
    assert min(lrs) >= 1e-5 and max(lrs) == pytest.approx(1e-3)


def test_scheduler_factory_follows_the_function():
    weight = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([{"params": [weight], "lr": 0.5}], lr=0.5)
    sched = warmup_cosine_scheduler(opt, warmup=4, total=30, min_lr_ratio=0.2)
    for step in range(35):
        assert opt.param_groups[0]["lr"] == pytest.approx(warmup_cosine(step, 4, 30, 0.5, 0.1), rel=1e-12)
        opt.step()
        sched.step()


@pytest.mark.parametrize("args, error", [
    ((-1, 10, 100, 1e-3, 0.0), ValueError),        # negative step
    ((1.5, 10, 100, 1e-3, 0.0), TypeError),        # fractional step
    ((True, 10, 100, 1e-3, 0.0), TypeError),       # a bool is not a step
    ((0, 101, 100, 1e-3, 0.0), ValueError),        # warmup longer than the run
    ((0, 10, 0, 1e-3, 0.0), ValueError),           # no steps
    ((0, 10, 100, 0.0, 0.0), ValueError),          # zero peak
    ((0, 10, 100, 1e-3, 2e-3), ValueError),        # min above peak
    ((0, 10, 100, 1e-3, -1e-4), ValueError),       # negative min
])
def test_schedule_rejects_bad_arguments(args, error):
    with pytest.raises(error):
        warmup_cosine(*args)


@pytest.mark.parametrize("warmup", [1, 4, 10])
def test_warmup_conventions(warmup):
    """``"one"``: step s runs at peak (s + 1) / warmup; ``"zero"`` (nanoGPT, CS336): at peak s / warmup,
    so step 0 runs at 0 and the peak comes at step ``warmup``. After warmup the two agree."""
    peak, low, total = 2.0, 0.2, 40
    for step in range(warmup):
        assert warmup_cosine(step, warmup, total, peak, low, warmup_start="zero") == \
            pytest.approx(peak * step / warmup, rel=1e-12, abs=0)
        assert warmup_cosine(step, warmup, total, peak, low, warmup_start="one") == \
            warmup_cosine(step, warmup, total, peak, low) == pytest.approx(peak * (step + 1) / warmup, rel=1e-12)
    assert warmup_cosine(0, warmup, total, peak, low, warmup_start="zero") == 0.0
    assert warmup_cosine(warmup, warmup, total, peak, low, warmup_start="zero") == pytest.approx(peak, rel=1e-12)
    for step in range(warmup, total + 5):
        assert warmup_cosine(step, warmup, total, peak, low, warmup_start="zero") == \
            warmup_cosine(step, warmup, total, peak, low, warmup_start="one")
    assert warmup_cosine(total, warmup, total, peak, low, warmup_start="zero") == pytest.approx(low, rel=1e-12)


def test_the_docstring_table():
    """The table in warmup_cosine's docstring: warmup 4, peak 1, steps 0..4."""
    one = [warmup_cosine(s, 4, 100, 1.0) for s in range(5)]
    zero = [warmup_cosine(s, 4, 100, 1.0, warmup_start="zero") for s in range(5)]
    assert one == [0.25, 0.5, 0.75, 1.0, 1.0] and zero == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert "0.25   0.50   0.75   1.00   1.00" in warmup_cosine.__doc__
    assert "0.00   0.25   0.50   0.75   1.00" in warmup_cosine.__doc__


@pytest.mark.parametrize("bad", ["One", "", None, 0, "step"])
def test_warmup_start_is_validated(bad):
    with pytest.raises(ValueError, match="warmup_start"):
        warmup_cosine(0, 4, 10, 1.0, warmup_start=bad)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="warmup_start"):
        warmup_cosine_scheduler(opt, 4, 10, warmup_start=bad)


def test_scheduler_factory_with_the_zero_convention():
    weight = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([weight], lr=0.5)
    sched = warmup_cosine_scheduler(opt, warmup=4, total=30, min_lr_ratio=0.2, warmup_start="zero")
    for step in range(35):
        assert opt.param_groups[0]["lr"] == pytest.approx(
            warmup_cosine(step, 4, 30, 0.5, 0.1, warmup_start="zero"), rel=1e-12, abs=0)
        opt.step()
        sched.step()


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------

def test_windows_are_consecutive_seeded_and_cover_the_end():
    tokens = torch.arange(50)
    data = TokenWindows(tokens, seq_len=7, seed=3)
    batch = data.sample(400)
    assert batch.shape == (400, 8) and batch.dtype == torch.int64
    assert torch.equal(batch, batch[:, :1] + torch.arange(8))        # each row: 8 consecutive ids
    assert int(batch[:, 0].min()) == 0 and int(batch[:, 0].max()) == 50 - 8   # first and last start both drawn
    assert torch.equal(TokenWindows(tokens, 7, seed=3).sample(400), batch)    # seeded
    assert not torch.equal(TokenWindows(tokens, 7, seed=4).sample(400), batch)
    assert data.windows_drawn == 400


def test_windows_resume_from_their_state():
    data = TokenWindows.from_text("essays", SEQ, seed=1)
    data.sample(5)
    state = data.state_dict()
    expected = data.sample(3)
    other = TokenWindows.from_text("essays", SEQ, seed=99)
    other.load_state_dict(state)
    assert torch.equal(other.sample(3), expected) and other.windows_drawn == 8
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindows.from_text("essays", SEQ + 1).load_state_dict(state)


@pytest.mark.parametrize("tokens, seq_len, error, match", [
    ([1, 2, 3], 1, TypeError, "tokens must be a torch.Tensor"),
    (torch.rand(20), 4, ValueError, "1-D integer"),
    (torch.zeros(2, 20, dtype=torch.long), 4, ValueError, "1-D integer"),
    (torch.arange(5), 5, ValueError, "too few"),
    (torch.arange(50), 0, ValueError, "seq_len must be >= 1"),
])
def test_windows_reject_bad_input(tokens, seq_len, error, match):
    with pytest.raises(error, match=match):
        TokenWindows(tokens, seq_len)


# ----------------------------------------------------------------------------------------------
# AdamW groups, clipping, accumulation
# ----------------------------------------------------------------------------------------------

def test_weight_decay_skips_norms_and_counts_tied_weights_once():
    tied = make_trainable(dataclasses.replace(CONFIG, tie_word_embeddings=True), seed=0)
    groups = adamw_param_groups(tied, 0.1)
    names = {id(p): n for n, p in tied.named_parameters()}
    decay = {names[id(p)] for p in groups[0]["params"]}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert no_decay and all(n.endswith("norm.weight") for n in no_decay)
    assert "embed_tokens.weight" in decay and all(n.endswith("proj.weight") or n.startswith("embed") for n in decay)
    assert sum(p.numel() for g in groups for p in g["params"]) == tied.num_parameters()  # tied matrix once
    assert adamw_param_groups(tiny_llama(), 0.1) == []        # inference model: nothing to train


def test_clip_matches_torch_and_returns_the_norm_before():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(5, 7), (7,), (3, 2, 4)]]
    grads = [torch.randn(p.shape, generator=g) * 3 for p in params]
    expected_norm = torch.cat([x.flatten() for x in grads]).norm()
    reference = [torch.nn.Parameter(torch.zeros(p.shape)) for p in params]
    for p, r, x in zip(params, reference, grads):
        p.grad, r.grad = x.clone(), x.clone()
    norm = clip_grad_norm(params, 1.0)
    torch_norm = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    assert norm == pytest.approx(float(expected_norm), rel=1e-6) and norm == pytest.approx(float(torch_norm), rel=1e-6)
    # same scale as torch's (1e-6 relative: two float32 reductions of ~90 values in another order)
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    assert float(torch.cat([p.grad.flatten() for p in params]).norm()) == pytest.approx(1.0, rel=1e-5)
    # below the threshold, or with max_norm=None, the gradients are only measured
    before = [p.grad.clone() for p in params]
    assert clip_grad_norm(params, 10.0) == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm(params, None) == pytest.approx(1.0, rel=1e-5)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(2))], 1.0) == 0.0   # no gradients at all
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(params, 0.0)


def test_accumulating_four_micro_batches_of_two_equals_one_batch_of_eight():
    big, accumulated = make_trainer(batch_size=8), make_trainer(batch_size=8, accum_steps=4)
    batch = big.data.sample(8)
    assert torch.equal(accumulated.data.sample(8), batch)       # same seed: the same windows
    loss_big = big.forward_backward(batch)
    loss_acc = accumulated.forward_backward(batch)
    # float32: each gradient entry sums 8·32 per-token terms; the micro-batches add them in four
    # groups of 64 and then add the groups, a different order. Rounding errors of such sums are a
    # few ulps of the largest partial sum, so 1e-5 of each tensor's largest entry bounds them
    # (measured: 4e-7); a missing 1/k factor or a dropped micro-batch is off by 25 % or more.
    assert loss_acc == pytest.approx(loss_big, rel=1e-6)
    for p, q in zip(big.parameters, accumulated.parameters):
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5 * scale)
    # and the trainer's own step draws one batch and splits it, whatever accum_steps is
    big2, acc2 = make_trainer(batch_size=8), make_trainer(batch_size=8, accum_steps=4)
    a, b = big2.train_step(), acc2.train_step()
    assert b.loss == pytest.approx(a.loss, rel=1e-6) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)


# ----------------------------------------------------------------------------------------------
# Training, logging, optimizer memory
# ----------------------------------------------------------------------------------------------

def test_loss_goes_down_and_every_step_is_logged():
    trainer = make_trainer()
    logs = trainer.train(15)
    assert [log.step for log in logs] == list(range(15)) and trainer.history == logs and trainer.step == 15
    # an untrained byte model is near uniform: ln 256 = 5.55 nats; 15 steps learn byte frequencies
    assert logs[0].loss == pytest.approx(math.log(256), abs=0.2)
    assert sum(log.loss for log in logs[-3:]) / 3 < logs[0].loss - 1.5
    for log in logs:
        assert isinstance(log, StepLog)
        assert log.lr == pytest.approx(warmup_cosine(log.step, 2, 20, 1e-2, 1e-3), rel=1e-12)
        assert log.tokens == 4 * SEQ and log.tokens_per_s > 0 and log.grad_norm > 0


def test_clipping_in_the_loop_caps_the_update():
    trainer = make_trainer(clip_norm=1e-3)
    log = trainer.train_step()
    assert log.grad_norm > 1e-3     # the logged norm is the one before clipping...
    # ...and the gradients the optimizer used were clipped to the threshold
    assert clip_grad_norm(trainer.parameters, None) == pytest.approx(1e-3, rel=1e-4)


def test_optimizer_memory_is_eight_bytes_per_parameter():
    trainer = make_trainer()
    n = trainer.model.num_parameters()
    assert optimizer_state_memory(trainer.optimizer) == OptimizerMemory(n, 0, 0, 0)  # state is created lazily
    trainer.train_step()
    memory = optimizer_state_memory(trainer.optimizer)
    assert memory.n_params == n
    assert memory.exp_avg_bytes == memory.exp_avg_sq_bytes == 4 * n
    assert memory.moment_bytes == adamw_state_bytes(n) == 8 * n and memory.bytes_per_param == 8.0
    assert memory.other_bytes == 4 * len(trainer.parameters)     # one float32 step counter per tensor
    assert adamw_state_bytes(n, torch.bfloat16) == 4 * n
    assert adamw_state_bytes(134_515_008) == 1_076_120_064       # SmolLM2-135M: about 1.08 GB
    with pytest.raises(TypeError, match="optimizer"):
        optimizer_state_memory(trainer.model)
    with pytest.raises(ValueError, match="n_params"):
        adamw_state_bytes(-1)


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

def test_resume_is_bit_identical(tmp_path):
    n, m = 3, 4
    straight = make_trainer()
    straight.train(n + m)

    first = make_trainer()
    first.train(n)
    first.save_checkpoint(tmp_path / "ckpt.pt")
    rng_at_save = torch.get_rng_state()
    torch.rand(10)                                   # move torch's global generator on
    # a fresh trainer: other initial weights, another data seed, a new optimizer
    resumed = make_trainer(model_seed=1, data_seed=5)
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    assert torch.equal(torch.get_rng_state(), rng_at_save) and resumed.step == n
    resumed.train(m)

    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    assert [log.loss for log in resumed.history] == [log.loss for log in straight.history]
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]
    for p, q in zip(straight.parameters, resumed.parameters):
        s, r = straight.optimizer.state[p], resumed.optimizer.state[q]
        assert torch.equal(s["exp_avg"], r["exp_avg"]) and torch.equal(s["exp_avg_sq"], r["exp_avg_sq"])

    # the test can fail: restoring only the weights (fresh AdamW, scheduler and sampler) diverges
    weights_only = make_trainer(model_seed=1)
    weights_only.model.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"])
    weights_only.train(m)
    assert any(not torch.equal(p, q) for p, q in zip(straight.model.parameters(), weights_only.model.parameters()))


def test_checkpoint_refuses_another_config(tmp_path):
    trainer = make_trainer()
    trainer.train_step()
    trainer.save_checkpoint(tmp_path / "ckpt.pt")
    assert not (tmp_path / "ckpt.pt.partial").exists()
    with pytest.raises(ValueError, match="total_steps=20"):
        make_trainer(total_steps=30).load_checkpoint(tmp_path / "ckpt.pt")


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, error, match", [
    (dict(batch_size=6, accum_steps=4), ValueError, "multiple of accum_steps"),
    (dict(batch_size=0), ValueError, "batch_size"),
    (dict(accum_steps=2.0), TypeError, "accum_steps"),
    (dict(warmup=30, total_steps=20), ValueError, "warmup"),
    (dict(min_lr=1.0, peak_lr=0.1), ValueError, "min_lr"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(betas=(0.9, 1.0)), ValueError, "betas"),
    (dict(clip_norm=0), ValueError, "clip_norm"),
])
def test_config_rejects_bad_values(settings, error, match):
    with pytest.raises(error, match=match):
        TrainConfig(**settings)


def test_trainer_rejects_bad_arguments():
    data = TokenWindows.from_text("essays", SEQ)
    with pytest.raises(ValueError, match="requires grad"):
        Trainer(tiny_llama(), TokenWindows(torch.arange(200) % 97, SEQ))
    with pytest.raises(TypeError, match="data must be a TokenWindows"):
        Trainer(make_trainable(CONFIG), torch.arange(100))
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        Trainer(make_trainable(CONFIG), data, {"total_steps": 10})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Trainer(make_trainable(CONFIG), TokenWindows.from_text("essays", 65))
    with pytest.raises(ValueError, match="steps"):
        Trainer(make_trainable(CONFIG), data).train(-1)
