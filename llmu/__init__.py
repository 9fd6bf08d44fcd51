"""llmu — LLM University: the library behind the course.

``llmu.runtime`` is imported first so that Triton runs in its interpreter on machines without a
GPU (see that module).
"""

from llmu import runtime  # noqa: F401  (must stay the first import: it sets TRITON_INTERPRET)

__version__ = "0.1.0"
__all__ = ["runtime", "__version__"]
