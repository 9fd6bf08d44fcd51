"""Module 12: Mixture-of-Experts — many feed-forward experts, a router, and ``k`` of them per token.

- ``reference``: the specification in PyTorch. Routing (``router_probs``, ``top_k_route`` with or
  without renormalising the ``k`` weights), capacity (``expert_capacity`` = ``ceil(capacity_factor
  * T * k / E)``, ``expert_positions``, ``dispatch_mask``: drops in token order), the auxiliary
  losses (``load_balancing_loss``, Switch Transformer's, generalised to top-k; ``router_z_loss``,
  ST-MoE's), ``route`` (the router half of a layer, returning a ``MoEAux``) and ``moe_reference``
  (the loop over experts). The layer functions take the router as its weight ``(E, H)`` or as
  precomputed ``router_logits=``, and the experts' gate and up projections as two ``(E, F, H)``
  weights or one fused ``w_gate_up=`` ``(E, 2F, H)`` (gate rows first: transformers' Mixtral and
  Qwen-MoE ``gate_up_proj``; ``split_gate_up`` gives the halves as views).
- ``kernels``: the GPU layout of the same layer in Triton: ``permute`` (a counting sort of the
  token copies by expert, rows gathered by a kernel), ``grouped_gemm`` (every expert's matmul in
  one launch over ragged groups; ``grouped_gemm_dw`` its weight gradient), ``unpermute`` (the
  gate-weighted combine), and ``moe_triton`` (permute -> grouped GEMM gate/up -> SwiGLU ->
  grouped GEMM down -> unpermute), forward and backward.
- ``layer``: ``MoEFeedForward``, the ``nn.Module`` the notebook trains: a router and the experts'
  weights (``fused_gate_up=True``: one ``w_gate_up``), run by ``moe_reference`` or ``moe_triton``
  (``impl``), differentiable on both paths.
- ``params``: total and active parameters and FLOPs per token of dense and MoE decoders
  (``count_parameters``, ``flops_per_token``, ``with_experts``; Mixtral-8x7B's 46.7B / 12.9B).
- ``train``: a small byte-level MoE language model trained on CPU, recording every expert's load
  at every step (``train``, ``load_stats``), for the collapse-versus-balance experiment.
- ``balance``: auxiliary-loss-free balancing (DeepSeek-V3): ``BiasBalancer``, a per-expert bias
  that only the top-k choice sees, moved by a fixed step against each expert's load after every
  training step (``train(balancer=...)``); layers take any such rule as ``select``.
- ``bench``: the ``moe_gather_rows``, ``moe_grouped_gemm``, ``moe_grouped_gemm_fine`` and ``moe_layer`` entries.
- ``expert_parallel``: the same layer with its experts spread over ``W`` ``torch.distributed``
  processes (``ExpertParallelMoE``, ``expert_parallel_moe``): tokens go to their experts' ranks
  and back by two all-to-all exchanges, forward and backward; ``launch(demo, 2)`` (from
  ``llmu.distributed``) runs it on two gloo processes and returns the traffic matrix.

This package imports nothing on its own, so that ``llmu.moe.reference`` and ``llmu.moe.layer``
can be used without importing Triton. ``kernels`` imports ``reference`` (its specification) and
``layer`` imports both, never the other way round.
"""
