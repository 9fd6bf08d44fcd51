"""Kernel and benchmark code imports with torch, Triton, numpy and einops only.

A GPU image may lack the packages that the notebooks, the tokenizer and the model files need
(tokenizers, gguf, safetensors, plotly, ipywidgets, nbgrader, Jupyter, IPython, transformers), and
``benchmarks/gpu.sh`` must still run every kernel test and benchmark there. This test imports
every ``llmu.<topic>.kernels`` and ``llmu.<topic>.bench`` in a subprocess where those packages
raise ImportError, each module from a fresh start (a module that failed once must not hide behind
a half-imported parent left in ``sys.modules``), then loads the benchmark registry strictly and runs
``python -m llmu.bench --list --strict``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ["tokenizers", "gguf", "plotly", "ipywidgets", "nbgrader", "jupyterlab", "jupyter",
           "jupyter_server", "jupyter_client", "notebook", "nbformat", "nbclient", "ipykernel",
           "IPython", "transformers", "accelerate", "safetensors", "psutil"]

BLOCKER = textwrap.dedent(f"""
    import importlib, importlib.abc, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {set(BLOCKED)!r}:
                raise ImportError(f"{{name}} is blocked by the test", name=name)
            return None

    sys.meta_path.insert(0, Blocked())
""")

CHECK = BLOCKER + textwrap.dedent("""
    import runpy

    import llmu.bench
    from llmu.bench.registry import TOPICS

    def forget_llmu():
        for name in [n for n in sys.modules if n == "llmu" or n.startswith("llmu.")]:
            del sys.modules[name]

    imported, failed = [], []
    for topic in TOPICS:
        for part in ("kernels", "bench"):
            module = f"llmu.{topic}.{part}"
            forget_llmu()
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name != module:
                    failed.append(f"{module}: {exc!r}")
            except Exception as exc:
                failed.append(f"{module}: {exc!r}")
            else:
                imported.append(module)
    for module in failed:
        print("FAILED", module)
    forget_llmu()
    from llmu.bench.registry import load_all
    registry = load_all(strict=True)
    print("imported", len(imported), "entries", len(registry))
    sys.argv = ["python -m llmu.bench", "--list", "--strict"]
    try:
        runpy.run_module("llmu.bench", run_name="__main__")
    except SystemExit as exc:
        print("llmu.bench exit", exc.code)
    sys.exit(1 if failed else 0)
""")


def test_kernel_and_bench_modules_import_without_notebook_or_model_packages():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "FAILED" not in out
    assert "llmu.bench exit 0" in out, out
    imported = int(out.split("imported ")[1].split()[0])
    assert imported >= 20, out  # most topics have kernels and a bench module
    assert int(out.split("entries ")[1].split()[0]) >= 20, out


def test_the_blocker_blocks():
    """The check above would pass vacuously if the blocked names still imported."""
    code = BLOCKER + "import llmu.models.tokenizer\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "tokenizers is blocked by the test" in proc.stderr
