"""llmu.training.checkpoint: a hand-written loop (llmu's AdamW, get_batch) that saves after N steps
and resumes in a fresh model and optimizer ends with the very weights of N + M steps straight."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmu.data import byte_tokens, text
from llmu.models import byte_llama_config, make_trainable
from llmu.training.adamw import AdamW
from llmu.training.batches import get_batch
from llmu.training.checkpoint import load_checkpoint, save_checkpoint
from llmu.training.loop import adamw_param_groups, warmup_cosine

CONFIG = byte_llama_config(32, 1, max_len=32, head_dim=8)
TOKENS = byte_tokens(text("essays")).numpy().astype(np.uint16)
STEPS = 12


pytestmark = pytest.mark.usefixtures("one_thread")    # tests/training/conftest.py


def fresh(seed=0, optimizer_cls=AdamW):
    model = make_trainable(CONFIG, seed=seed)
    kwargs = {"foreach": False} if optimizer_cls is torch.optim.AdamW else {}
    return model, optimizer_cls(adamw_param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), **kwargs)


def train(model, opt, gen, start, stop):
    for it in range(start, stop):
        for group in opt.param_groups:
            group["lr"] = warmup_cosine(it, 3, STEPS, 1e-2, 1e-3)
        x, y = get_batch(TOKENS, 4, 16, generator=gen)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).logits.reshape(-1, 256), y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def straight(optimizer_cls=AdamW):
    model, opt = fresh(optimizer_cls=optimizer_cls)
    train(model, opt, torch.Generator().manual_seed(0), 0, STEPS)
    return model


@pytest.mark.parametrize("where", ["path", "pathlib", "bytesio", "open-file"])
@pytest.mark.parametrize("optimizer_cls", [AdamW, torch.optim.AdamW], ids=["llmu", "torch"])
def test_resume_is_exact(where, optimizer_cls, tmp_path):
    want = straight(optimizer_cls)
    model, opt = fresh(optimizer_cls=optimizer_cls)
    gen = torch.Generator().manual_seed(0)
    train(model, opt, gen, 0, 5)
    target = {"path": str(tmp_path / "ck.pt"), "pathlib": tmp_path / "ck.pt", "bytesio": io.BytesIO()}.get(where)
    if where == "open-file":
        with open(tmp_path / "ck.pt", "wb") as f:
            save_checkpoint(model, opt, 5, f, extra={"data": gen})
    else:
        save_checkpoint(model, opt, 5, target, extra={"data": gen})
    if where == "bytesio":
        target.seek(0)
    del model, opt
    model, opt = fresh(seed=1, optimizer_cls=optimizer_cls)              # other weights, empty state
    gen = torch.Generator().manual_seed(123)                             # another data order
    if where == "open-file":
        with open(tmp_path / "ck.pt", "rb") as f:
            it = load_checkpoint(f, model, opt, extra={"data": gen})
    else:
        it = load_checkpoint(target, model, opt, extra={"data": gen})
    assert it == 5
    train(model, opt, gen, it, STEPS)
    for (name, a), b in zip(model.named_parameters(), want.parameters()):
        assert torch.equal(a, b), name
    if where in ("path", "pathlib"):
        assert sorted(os.listdir(tmp_path)) == ["ck.pt"]                 # nothing left beside it


def test_without_the_optimizer_state_the_run_differs(tmp_path):
    """The reason the optimizer's state is saved: restoring the weights alone (and the data order)
    does not continue the run."""
    want = straight()
    model, opt = fresh()
    gen = torch.Generator().manual_seed(0)
    train(model, opt, gen, 0, 5)
    save_checkpoint(model, opt, 5, tmp_path / "ck.pt", extra={"data": gen})
    model2, opt2 = fresh(seed=1)
    load_checkpoint(tmp_path / "ck.pt", model2, opt2, extra={"data": gen})
    opt2.state.clear()                                                   # m = v = 0 again
    train(model2, opt2, gen, 5, STEPS)
    assert not all(torch.equal(a, b) for a, b in zip(model2.parameters(), want.parameters()))


def test_extra_objects_with_state_dict(tmp_path):
    model, opt = fresh()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        opt.step()                                                       # no gradients yet: a no-op
        sched.step()
    save_checkpoint(model, opt, 3, tmp_path / "ck.pt", extra={"scheduler": sched})
    model2, opt2 = fresh(seed=1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    assert load_checkpoint(tmp_path / "ck.pt", model2, opt2, extra={"scheduler": sched2}) == 3
    assert sched2.last_epoch == 3
    with pytest.raises(KeyError, match="data"):
        load_checkpoint(tmp_path / "ck.pt", model2, opt2, extra={"data": torch.Generator()})


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = fresh()
    path = tmp_path / "ck.pt"
    save_checkpoint(model, opt, 1, path)
    before = path.read_bytes()

    def broken_save(obj, f):
        with open(f, "wb") as out:
            out.write(b"half a file")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(model, opt, 2, path)
    assert path.read_bytes() == before


def test_loading_refuses_pickled_code(tmp_path):
    """weights_only=True: a file that would unpickle an arbitrary object is refused."""
    model, opt = fresh()
    torch.save({"iteration": 0, "model": {}, "optimizer": {}, "extra": {}, "evil": print}, tmp_path / "bad.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
        load_checkpoint(tmp_path / "bad.pt", model, opt)


@pytest.mark.parametrize("call, error, name", [
    (lambda m, o, p: save_checkpoint("model", o, 0, p), TypeError, "model"),
    (lambda m, o, p: save_checkpoint(m, "opt", 0, p), TypeError, "optimizer"),
    (lambda m, o, p: save_checkpoint(m, o, -1, p), ValueError, "iteration"),
    (lambda m, o, p: save_checkpoint(m, o, 1.5, p), TypeError, "iteration"),
    (lambda m, o, p: save_checkpoint(m, o, 0, 42), TypeError, "out"),
    (lambda m, o, p: save_checkpoint(m, o, 0, p, extra={"x": object()}), TypeError, "extra"),
    (lambda m, o, p: load_checkpoint(42, m, o), TypeError, "src"),
    (lambda m, o, p: load_checkpoint(p, m, None), TypeError, "optimizer"),
])
def test_bad_input(call, error, name, tmp_path):
    model, opt = fresh()
    with pytest.raises(error, match=name):
        call(model, opt, tmp_path / "ck.pt")
