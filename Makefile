# Two entry points (see README): `make run` and `make test`. Each sets up .venv first, installing the
# package with what that command needs and nothing more: `make run` the package alone (torch, numpy),
# `make bench` the plots extra, `make docs` and `make notebooks` theirs, `make test` the test extra
# (all of them: sphinx, jupyter, selenium, matplotlib, about 1.5 GB).
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
# $(VENV)/.installed-EXTRA: the package is installed with EXTRA (base: none) for the current pyproject.toml
STAMP := $(VENV)/.installed-test
DOCS_OUT ?= _build/html
# The browser test (tests/test_docs.py) skips, saying what to install, when chromium is missing,
# unless OFFLOAD_EXAMPLES_REQUIRE_BROWSER=1: then it fails instead. CI (CI=true) requires it.
OFFLOAD_EXAMPLES_REQUIRE_BROWSER ?= $(if $(filter true 1,$(CI)),1,)
export OFFLOAD_EXAMPLES_REQUIRE_BROWSER
BROWSER_HINT := sudo apt-get install --no-install-recommends chromium chromium-driver

.PHONY: setup browser run test test-gpu bench docs notebooks clean

setup: $(STAMP)  ## .venv with everything the tests need

$(VENV)/.installed-%: pyproject.toml
	@echo "setting up $(VENV): torch if it has none, then offload_examples$(if $(filter base,$*),,[$*]) (pip, editable)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".$(if $(filter base,$*),,[$*])"
	touch $@

# The docs test drives a real browser: Debian's chromium and chromedriver. They are installed with
# apt-get as root or with password-less sudo, without recommended packages (26 packages, 420 MB on
# Debian 12, against 132 with them), after a line saying so; otherwise this says what to install and
# how, and `make test` goes on: the browser test then skips with that reason, or fails where it is required.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null && exit 0; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=sudo; \
	else SUDO=none; fi; \
	if [ "$$SUDO" != none ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium and chromium-driver with apt-get (no recommended packages) for the docs' browser test"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    chromium chromium-driver >/dev/null \
	  && exit 0; \
	  echo "apt-get could not install chromium and chromium-driver"; \
	fi; \
	echo "the browser test needs chromium and chromedriver; install them with:"; \
	echo "    $(BROWSER_HINT)"; \
	if [ "$$OFFLOAD_EXAMPLES_REQUIRE_BROWSER" = 1 ]; then \
	  echo "OFFLOAD_EXAMPLES_REQUIRE_BROWSER=1: the browser test will fail"; \
	else echo "going on without them: the browser test will be skipped (OFFLOAD_EXAMPLES_REQUIRE_BROWSER=1 fails it)"; fi

run: $(VENV)/.installed-base  ## the basic scenario and its report (full size on a GPU, small on a CPU)
	mkdir -p results
	$(PY) -m offload_examples basic --json results/basic.json

test: $(STAMP) browser  ## the whole test suite (GPU tests run too when CUDA is present; CI=true requires the browser)
	$(PY) -m pytest

# REPEAT=3 runs them three times in one process (tests/repeat.py): leaks and a poisoned CUDA context
# show only when the same process runs the tests again.
REPEAT ?= 1
test-gpu: $(STAMP)  ## GPU tests only, failing if CUDA is missing; REPEAT=N runs them N times in one process
	OFFLOAD_EXAMPLES_REQUIRE_GPU=1 $(PY) tests/repeat.py $(REPEAT) -m gpu

bench: $(VENV)/.installed-plots  ## every strategy side by side: results/bench/bench.{json,md} and plots (tiny on a CPU)
	$(PY) -m offload_examples bench --out results/bench

docs: $(VENV)/.installed-docs  ## build the site from the notebooks' stored outputs, warnings and broken references as errors; entry page $(DOCS_OUT)/index.html
	$(PY) -m sphinx -W --keep-going -b html . $(DOCS_OUT)

notebooks: $(VENV)/.installed-notebooks  ## re-execute every notebook in place at full size (on a GPU node)
	$(PY) -m offload_examples.instruments.notebooks notebooks/*.ipynb --inplace

clean:
	rm -rf $(VENV) results _build build *.egg-info
