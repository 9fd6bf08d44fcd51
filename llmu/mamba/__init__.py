"""Mamba and selective state spaces (course module 13).

- :mod:`llmu.mamba.reference`: the torch definitions. ``discretize`` (zero-order hold for ``A``,
  the reference's ``Δ B u`` for ``B``) and ``zoh_discretize`` (the exact hold for ``B`` too); three
  ways to run the recurrence ``x_t = exp(Δ_t A) x_{t-1} + Δ_t B_t u_t``, ``y_t = C_t · x_t``:
  ``selective_scan_sequential`` (a loop over time, the specification), ``selective_scan_parallel``
  (a parallel prefix scan with the associative operator ``combine``, Hillis–Steele or
  Blelloch, differentiable) and
  ``selective_state_step`` (one step, for decoding with constant memory).
- :mod:`llmu.mamba.kernels`: ``selective_scan_triton``, the chunked Triton scan that keeps the
  state in registers, and its backward in Triton (``SelectiveScanFunction``: the forward stores one
  state per chunk, the backward recomputes the chunk's states from it and scans the gradient
  backwards in time).
- :mod:`llmu.mamba.block`: ``MambaBlock`` (in_proj, causal conv, selective SSM, gate, out_proj;
  ``forward``, ``step``, ``allocate_state``; ``selective=False`` fixes Δ, B and C, the
  time-invariant ablation) and ``MambaLM``, a tiny language model for CPU training.
- :mod:`llmu.mamba.tasks`: the selective-copying task of the Mamba paper and plain copying
  (seeded batches, loss and accuracy on the answer positions only).
- :mod:`llmu.mamba.train`: a small ``MambaLM`` and a same-size attention model (llmu's Llama
  decoder) trained on those tasks on CPU (``train_copying``); ``mamba_model(block_class=...)``
  builds the model from blocks of a learner's own class (notebook 13's selection ablation).
- :mod:`llmu.mamba.picture`: the Blelloch scan recorded round by round, and the figure the
  notebook's slider draws.
- :mod:`llmu.mamba.bench`: the ``mamba_selective_scan`` benchmark entry (the scan beside attention).

Semantics follow ``selective_scan_ref`` published with the Mamba paper (Gu & Dao, 2023). This
package imports nothing on its own, so that the torch parts can be used without importing Triton.
"""
