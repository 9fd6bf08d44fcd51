"""llmu.training.batches.get_batch: shapes, the shift by one, every start reachable, the generator,
and a memmap far larger than what the process reads."""

from __future__ import annotations

import gc
import os

import numpy as np
import psutil
import pytest
import torch

from llmu.training.batches import get_batch


@pytest.mark.parametrize("kind", ["numpy-uint16", "numpy-int32", "memmap", "torch-int64", "torch-int32"])
@pytest.mark.parametrize("batch_size, context_length", [(1, 1), (4, 8), (7, 13)])
def test_windows_are_slices_shifted_by_one(kind, batch_size, context_length, tmp_path):
    n = 97
    ids = (np.arange(n) * 7 + 3) % 251            # distinct enough to locate each window
    if kind.startswith("numpy"):
        tokens = ids.astype(kind.split("-")[1])
    elif kind == "memmap":
        tokens = np.memmap(tmp_path / "ids.bin", dtype=np.uint16, mode="w+", shape=(n,))
        tokens[:] = ids
        tokens.flush()
        tokens = np.memmap(tmp_path / "ids.bin", dtype=np.uint16, mode="r")
    else:
        tokens = torch.from_numpy(ids).to(getattr(torch, kind.split("-")[1]))
    x, y = get_batch(tokens, batch_size, context_length, generator=torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (batch_size, context_length)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])                          # y is x shifted by one
    full = torch.from_numpy(ids.astype(np.int64))
    for row_x, row_y in zip(x, y):
        starts = [s for s in range(n - context_length) if torch.equal(full[s:s + context_length], row_x)]
        assert starts, "each input row is a slice of tokens"
        assert any(torch.equal(full[s + 1:s + 1 + context_length], row_y) for s in starts)


def test_every_start_is_reachable_and_none_past_the_end():
    """With n ids and context T, the starts are exactly 0 .. n - T - 1 (the last window ends on the
    last id), each drawn about equally often."""
    n, T = 20, 5
    tokens = np.arange(n, dtype=np.int64)                            # the id is its position
    g = torch.Generator().manual_seed(0)
    x, y = get_batch(tokens, 30_000, T, generator=g)
    counts = torch.bincount(x[:, 0], minlength=n)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(range(n - T))
    assert y.max().item() == n - 1
    expected = 30_000 / (n - T)
    assert (counts[: n - T].float() - expected).abs().max() < 5 * expected ** 0.5   # 5 sigma


def test_the_generator_decides_the_batch():
    tokens = np.arange(1000, dtype=np.uint16)
    a = get_batch(tokens, 8, 16, generator=torch.Generator().manual_seed(3))
    b = get_batch(tokens, 8, 16, generator=torch.Generator().manual_seed(3))
    c = get_batch(tokens, 8, 16, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    torch.manual_seed(5)
    d = get_batch(tokens, 8, 16)                                      # torch's global generator
    torch.manual_seed(5)
    assert torch.equal(d[0], get_batch(tokens, 8, 16)[0])


def test_a_window_as_long_as_the_array():
    x, y = get_batch(np.arange(9), 3, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, torch.arange(8).expand(3, 8)) and torch.equal(y, torch.arange(1, 9).expand(3, 8))


def test_device_argument():
    x, y = get_batch(np.arange(50), 2, 4, device="cpu")
    assert x.device.type == y.device.type == "cpu"
    if torch.cuda.is_available():
        x, y = get_batch(np.arange(50), 2, 4, device="cuda")
        assert x.is_cuda and y.is_cuda


def test_a_memmap_larger_than_what_is_read(tmp_path):
    """500 M uint16 ids (a 954 MiB file, sparse: no disk blocks are written): 10 batches of 64
    windows must not read the whole file. The resident memory grows by the pages the windows touch,
    and by the pages the kernel maps around each fault (up to 64 KiB), so by tens of MiB at most:
    the bound is a tenth of the file."""
    n = 500_000_000
    path = tmp_path / "corpus.bin"
    with open(path, "wb") as f:
        f.truncate(2 * n)
    tokens = np.memmap(path, dtype=np.uint16, mode="r", shape=(n,))
    get_batch(np.arange(10), 1, 1)                                    # warm up torch's code paths
    gc.collect()
    process = psutil.Process(os.getpid())
    before = process.memory_info().rss
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        x, y = get_batch(tokens, 64, 256, generator=g)
    grown = process.memory_info().rss - before
    assert x.shape == (64, 256) and int(x.max()) == 0                # the file holds zeros
    assert grown < 2 * n / 10, f"RSS grew by {grown / 2**20:.1f} MiB for a {2 * n / 2**20:.0f} MiB file"
    # a memmap with a header offset, as np.save's .npy files are laid out
    np.save(tmp_path / "ids.npy", np.arange(1000, dtype=np.uint16))
    loaded = np.load(tmp_path / "ids.npy", mmap_mode="r")
    x, y = get_batch(loaded, 4, 10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(y, x + 1)


@pytest.mark.parametrize("args, kwargs, error, name", [
    (([1.0, 2.0, 3.0], 1, 1), {}, TypeError, "tokens"),
    ((np.arange(10.0), 1, 1), {}, ValueError, "tokens"),
    ((np.arange(10).reshape(2, 5), 1, 1), {}, ValueError, "tokens"),
    ((torch.rand(10), 1, 1), {}, ValueError, "tokens"),
    ((np.arange(10), 0, 1), {}, ValueError, "batch_size"),
    ((np.arange(10), 2.0, 1), {}, TypeError, "batch_size"),
    ((np.arange(10), 1, 0), {}, ValueError, "context_length"),
    ((np.arange(10), 1, 10), {}, ValueError, "too few"),
    ((np.arange(10), 1, 2), {"generator": 0}, TypeError, "generator"),
])
def test_bad_input(args, kwargs, error, name):
    with pytest.raises(error, match=name):
        get_batch(*args, **kwargs)
