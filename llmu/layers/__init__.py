"""The parts of a Llama block around attention: RMSNorm, rotary embeddings (RoPE), SwiGLU.

- :mod:`llmu.layers.reference`: the torch definitions (``rms_norm``, ``rope_angles``,
  ``apply_rope``, ``silu_mul``, ``swiglu``), which ``llmu.models`` builds its decoder from;
- :mod:`llmu.layers.kernels`: the Triton versions, forward and backward (``rms_norm``, ``rope``
  applied in place, ``swiglu_fused``), one file each in ``rmsnorm.py``, ``rope.py``, ``swiglu.py``;
- :mod:`llmu.layers.bench`: their benchmark entries (bytes and flops per call).

Course notebook: ``03_rope_swiglu_rmsnorm``. This package imports nothing on its own, so that
``llmu.models`` can use the references without importing Triton.
"""
