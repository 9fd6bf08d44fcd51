"""Module 11: speculative decoding — a cheap draft proposes, the target verifies, the output is exact.

- ``reference``: the accept/reject rule of speculative sampling in PyTorch (batched; greedy as a
  special case), the specification every other part is tested against.
- ``kernels``: the same accept/reject step as one Triton kernel (``accept_reject``,
  ``speculative_sample``): one program per sequence walks the proposals, then samples the token
  after the accepted prefix by inverse CDF over the vocabulary in tiles — one launch, no host
  synchronisation inside the step. Both take what a serving engine passes: ragged batches
  (``draft_lens``, a number of proposals per sequence, 0 included) and its own ``bonus_token``.
- ``drafts``: what proposes: :class:`~llmu.spec.drafts.EarlyExitDraft` (the target's first ``k``
  blocks and its head, self-speculative), :class:`~llmu.spec.drafts.QuantizedDraft` (the whole
  target at 4 bits, its step in ``quantized_step``) and :class:`~llmu.spec.drafts.NGramDraft`
  (prompt lookup);
  ``rewind`` crops a KV cache back to the prefix a new context shares with it;
- ``decode``: the loop (``speculative_generate``: propose, verify in one target pass, accept,
  rewind) with its statistics, and ``expected_tokens_per_step``; the target keeps its keys and
  values in a ``ContiguousTarget`` (module 06's cache) or a ``paged.PagedTarget`` (module 09's
  block pool, rolled back with ``BlockManager.truncate``);
- ``tree``: tree speculation (SpecInfer, Medusa, EAGLE): a tree of drafts verified in one target
  pass, with a mask that lets each node see only the context and its ancestors and positions by
  depth (``tree_mask``, ``tree_positions``, ``verify_greedy``, the loop ``tree_generate``), and
  prompt lookup as a tree (``NGramTreeDraft``);
- ``prompts``: the prompts drafts are measured on (``edit``, ``summarise``, ``story``);
- ``stats``: the chi-square goodness-of-fit test the exactness checks use.
"""
