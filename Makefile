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
DOCS_OUT ?= _build/html

.PHONY: setup browser run test test-gpu bench docs notebooks clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

# The docs test drives a real browser: Debian's chromium and chromedriver.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  echo "installing chromium and chromedriver for the browser test"; \
	  SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; }

run: $(STAMP)  ## the basic scenario and its report (full size on a GPU, small on a CPU)
	$(PY) -m offload_examples basic --json results/basic.json

test: $(STAMP) browser  ## the whole test suite (GPU tests run too when CUDA is present)
	$(PY) -m pytest

test-gpu: $(STAMP)  ## GPU tests only, failing if CUDA is missing
	OFFLOAD_EXAMPLES_REQUIRE_GPU=1 $(PY) -m pytest -m gpu

bench: $(STAMP)  ## every strategy side by side: results/bench/bench.{json,md} and plots (tiny on a CPU)
	$(PY) -m offload_examples.bench --out results/bench

docs: $(STAMP)  ## build the site with warnings as errors (renders the notebooks' stored outputs)
	$(PY) -m sphinx -W --keep-going -b html . $(DOCS_OUT)

notebooks: $(STAMP)  ## re-execute every notebook in place at full size (on a GPU node)
	$(PY) -m offload_examples.notebooks notebooks/*.ipynb --inplace

clean:
	rm -rf $(VENV) results _build build *.egg-info
