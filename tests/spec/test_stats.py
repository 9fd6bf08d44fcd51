"""``llmu.spec.stats.chi_square_pvalue``: the goodness-of-fit test the exactness checks rely on.
(The tail function ``chi2_sf`` is checked against tables in ``test_reference.py``.)"""

from __future__ import annotations

import pytest
import torch

from llmu.spec.stats import chi_square_pvalue


def test_fits_and_misfits():
    p = torch.tensor([0.5, 0.3, 0.2])
    assert chi_square_pvalue(torch.tensor([500.0, 300, 200]), p) > 0.99
    assert chi_square_pvalue(torch.tensor([700.0, 200, 100]), p) < 1e-20
    assert chi_square_pvalue(torch.tensor([500.0, 300, 199, 1]), torch.tensor([0.5, 0.3, 0.2, 0.0])) == 0.0


def test_rare_cells_pooled():
    p = torch.tensor([0.6, 0.394, 0.003, 0.003])  # 1000 samples: the last two expect 3 each
    counts = torch.tensor([600.0, 394, 3, 3])
    with pytest.raises(ValueError, match="too few samples"):
        chi_square_pvalue(counts, p)
    assert chi_square_pvalue(counts, p, pool_below=5) > 0.99          # pooled: 6 expected, 6 seen
    assert chi_square_pvalue(torch.tensor([600.0, 374, 13, 13]), p, pool_below=5) < 1e-10
    # a pooled tail still under 5 joins the smallest cell kept
    assert chi_square_pvalue(torch.tensor([600.0, 394, 3, 3]), torch.tensor([0.6, 0.396, 0.002, 0.002]),
                             pool_below=5) > 0.99


def test_bad_inputs():
    with pytest.raises(ValueError, match="one shape"):
        chi_square_pvalue(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="one shape"):
        chi_square_pvalue([1, 2], torch.ones(2))
