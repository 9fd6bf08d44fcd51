"""Module 12: Mixture-of-Experts — many feed-forward experts, a router, and ``k`` of them per token.

- ``reference``: the specification in PyTorch. Routing (``router_probs``, ``top_k_route`` with or
  without renormalising the ``k`` weights), capacity (``expert_capacity`` = ``ceil(capacity_factor
  * T * k / E)``, ``expert_positions``, ``dispatch_mask``: drops in token order), the auxiliary
  losses (``load_balancing_loss``, Switch Transformer's, generalised to top-k; ``router_z_loss``,
  ST-MoE's), ``route`` (the router half of a layer, returning a ``MoEAux``), ``moe_reference``
  (the loop over experts) and ``MoEFeedForward`` (the ``nn.Module``, differentiable on its torch
  path, which the notebook trains).
- ``kernels``: the GPU layout of the same layer in Triton: ``permute`` (a counting sort of the
  token copies by expert, rows gathered by a kernel), ``grouped_gemm`` (every expert's matmul in
  one launch over ragged groups; ``grouped_gemm_dw`` its weight gradient), ``unpermute`` (the
  gate-weighted combine), and ``moe_triton`` (permute -> grouped GEMM gate/up -> SwiGLU ->
  grouped GEMM down -> unpermute), forward and backward.

This package imports nothing on its own, so that ``llmu.moe.reference`` can be used without
importing Triton.
"""
