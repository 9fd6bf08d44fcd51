"""Module 02: attention and softmax with temperature.

- ``llmu.attention.reference``: PyTorch references (softmax with temperature, ``repeat_kv``,
  ``causal_mask``, naive ``attention`` with grouped-query heads);
- ``llmu.attention.kernels``: the same in Triton (a fused softmax with temperature that streams rows
  of any length, and a naive attention forward that materialises the scores);
- ``llmu.attention.bench``: their benchmark entries (``softmax_temperature``, ``attention_naive``).

The notebook is ``solutions/02_attention/02_attention.ipynb``.
"""
