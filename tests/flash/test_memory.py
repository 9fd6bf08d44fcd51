"""peak_bytes: counts live tensor storage created by a call; naive attention grows as N², the tiled
algorithm as N."""

import torch

from llmu.attention.reference import attention
from llmu.flash import reference
from llmu.flash.memory import peak_bytes


def test_peak_counts_live_storages_once():
    x = torch.zeros(1000)

    def f(x):
        a = x + 1              # 4000 bytes
        b = a.view(10, 100)    # a view: no new storage
        c = b * 2              # 4000 more, both alive
        del a, b
        return c.sum()

    _, peak = peak_bytes(f, x)
    assert peak == 8000 + 4 or peak == 8000   # the scalar sum may be allocated while c is alive

    def g(x):
        for _ in range(5):
            y = x * 2          # each y dies before the next: the peak stays at about two of them
            del y
        return None

    assert peak_bytes(g, x)[1] <= 8000


def test_naive_quadratic_tiled_linear():
    peaks = {}
    for n in (256, 512):
        q, k, v = (torch.randn(1, 1, n, 32) for _ in range(3))
        with torch.no_grad():
            peaks[n] = (peak_bytes(attention, q, k, v, causal=True)[1],
                        peak_bytes(reference.flash_attention, q, k, v, causal=True)[1])
    assert peaks[256][0] >= 256 * 256 * 4          # at least the float32 score matrix
    assert 3.5 < peaks[512][0] / peaks[256][0] < 4.5   # doubling N: 4x the memory
    assert peaks[512][1] / peaks[256][1] < 2.5         # doubling N: about 2x
    assert peaks[512][1] < peaks[512][0] / 3


def test_views_of_the_inputs_are_not_new_memory():
    x = torch.randn(64, 32)
    assert peak_bytes(lambda t: t.T[::2], x)[1] == 0                     # views share x's storage
    assert peak_bytes(lambda t: t.T.contiguous(), x)[1] == x.numel() * 4  # a copy is new memory
