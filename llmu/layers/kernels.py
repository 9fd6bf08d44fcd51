"""Triton kernels for the parts of a Llama block, forward and backward.

One file per op, each with its kernels, a validating launcher and an ``autograd.Function``:

- :mod:`llmu.layers.rmsnorm`: :func:`rms_norm` (backward for ``x`` and the gain ``weight``);
- :mod:`llmu.layers.rope`: :func:`rope`, rotary embeddings applied **in place** to q and k, in the
  ``"half"`` and ``"interleaved"`` layouts;
- :mod:`llmu.layers.swiglu`: :func:`swiglu_fused`, ``silu(gate) * up`` in one pass.

They compute in fp32 whatever the storage dtype (fp32, fp16, bf16) and are tested against the
torch references in :mod:`llmu.layers.reference`.
"""

from llmu.layers.rmsnorm import RMSNormFunction, rms_norm
from llmu.layers.rope import RoPEFunction, rope
from llmu.layers.swiglu import SwiGLUFunction, swiglu_fused

__all__ = ["rms_norm", "rope", "swiglu_fused", "RMSNormFunction", "RoPEFunction", "SwiGLUFunction"]
