# Two entry points (see README): `make run` and `make test`. Each sets up .venv first.
#
# torch: this project needs any torch >= 2.4. A plain `pip install torch` pulls a CUDA build and
# several GB of CUDA packages, so the set-up installs TORCH_SPEC only when the venv has no torch:
# by default torch==2.13.0, which on our CI machines resolves to a local CPU wheel (pip's
# find-links). Elsewhere pick what suits you, e.g.
#   make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
#   make test VENV_FLAGS=--system-site-packages        # reuse a torch already installed
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

run: $(STAMP)  ## the basic scenario and its report (full size on a GPU, small on a CPU)
	$(PY) -m offload_examples basic --json results/basic.json

test: $(STAMP)  ## the whole test suite (GPU tests run too when CUDA is present)
	$(PY) -m pytest

test-gpu: $(STAMP)  ## GPU tests only, failing if CUDA is missing
	OFFLOAD_EXAMPLES_REQUIRE_GPU=1 $(PY) -m pytest -m gpu

clean:
	rm -rf $(VENV) results build *.egg-info
