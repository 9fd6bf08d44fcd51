"""Module 11: speculative decoding — a cheap draft proposes, the target verifies, the output is exact.

- ``reference``: the accept/reject rule of speculative sampling in PyTorch (batched; greedy as a
  special case), the specification every other part is tested against.
- ``kernels``: the same accept/reject step as one Triton kernel (``accept_reject``,
  ``speculative_sample``): one program per sequence walks the proposals, then samples the token
  after the accepted prefix by inverse CDF over the vocabulary in tiles — one launch, no host
  synchronisation inside the step.
"""
