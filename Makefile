# `make run` and `make test` do all set-up on a fresh machine: they create the
# virtual environment and install the pinned dependency set if it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-slow lint typecheck docs browser bench bench-accelerator accelerator-window bench-against cuda clean-venv

# Quiet (-qq): errors only; a machine's pip configuration may name package
# folders it lacks, which pip would otherwise report on every install.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV) (the pinned dependency set, a few minutes)"
	@$(PY) -m pip install -qq --upgrade pip
	@$(PY) -m pip install -qq -c constraints.txt -e ".[test]"
	@touch $(STAMP)

# The default benchmark: spectra, timing and training on the three small
# problems, then the merged report (reports/quick/report/report.md + figures).
run: $(STAMP)
	@$(VENV)/bin/curvbench

# Tests check values, not speed: XLA's CPU code generation at its lowest
# optimisation level compiles about a fifth faster (runs and benchmarks keep
# the default).
TEST_XLA = XLA_FLAGS="--xla_backend_optimization_level=0 $$XLA_FLAGS"

# The checks and the fast tier of the tests, within 15 minutes on 2 cores:
# everything but the tests marked slow and the timing benchmarks.
test: $(STAMP) browser lint typecheck
	$(TEST_XLA) $(PY) -m pytest -n 2 -q -m "not slow" --ignore=tests/benchmarks

# The rest, which CI runs after `make test`: the slow tests (whole sweeps,
# commands in their own processes, framework and paper-size models), and each
# benchmark run once, untimed.
test-slow: $(STAMP) browser
	$(TEST_XLA) $(PY) -m pytest -n 2 -q -m slow --ignore=tests/benchmarks
	$(TEST_XLA) $(PY) -m pytest -n 2 -q --benchmark-disable tests/benchmarks

# The linter's rules and the formatter's style are in pyproject.toml
# ([tool.ruff]); `ruff format .` applies the style. tools/docstrings.py
# names every public function, class or method left without a docstring.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tools/docstrings.py

# The type checker; what it checks and how strictly is in pyproject.toml
# ([tool.mypy]).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The documentation site, warnings as errors: docs/_build/html/index.html.
# The tutorials run while it builds (a few minutes on 2 cores).
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html

# Debian's chromium, for the tests that open generated HTML pages in a headless
# browser; installed only where we are root with apt-get, else those tests skip.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends chromium; \
	else \
	  echo "note: no /usr/bin/chromium (install: apt-get install chromium)" \
	    "- the browser tests will skip"; \
	fi

# The CUDA build of jax for NVIDIA GPUs (then run with device=gpu, or auto).
cuda: $(STAMP)
	$(PY) -m pip install -qq -c constraints.txt -e ".[test,cuda]"
	$(PY) -c "import jax; print('jax sees', jax.devices())"

# The benchmark of record (`python -m curvbench.bench run`): K-FAC / Adam on
# every problem, the MLP's exact GGN spectrum, the dataset GGN-vector product
# per gradient, per-phase costs; a report in reports/bench/ (or BENCH_OUT),
# compared with this device kind's record in benchmarks/record/ (exit 1 when a
# figure is more than 25 % worse). REF=<commit> also times that commit side
# by side with the working tree.
BENCH_ARGS = $(if $(BENCH_OUT),--out $(BENCH_OUT)) $(if $(REF),--against $(REF))

bench: $(STAMP)
	$(PY) -m pytest tests/benchmarks -p no:xdist --benchmark-only --benchmark-columns=median,iqr,rounds
	$(PY) -m curvbench.bench run --compare $(BENCH_ARGS)

# The same on an accelerator, in one command: first the CUDA build of jax
# where nvidia-smi sees a GPU and jax runs on the CPU; then cost against model
# size at the accelerator's sizes (`python -m curvbench.bench scaling`).
bench-accelerator: $(STAMP)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
	  && [ "$$($(PY) -c 'import jax; print(jax.default_backend())' 2>/dev/null)" = cpu ]; \
	then $(MAKE) cuda; fi
	$(PY) -m curvbench.bench run --compare $(BENCH_ARGS)
	$(PY) -m curvbench.bench scaling $(if $(BENCH_OUT),--out $(BENCH_OUT)-scaling)

# Everything accelerator-related in one lent device's time, most wanted
# first (`python -m curvbench.bench window`): the benchmark of record, its
# scaling, paper_scale, the gallery's accelerator sizes, the K-FAC paper's
# window variant, each with a hard timeout, within 600 s (WINDOW_BUDGET);
# each part's outputs and one summary in reports/window/<date>/ (or
# WINDOW_OUT); WINDOW_PARTS=a,b runs those only. The CUDA build as
# bench-accelerator installs it; ACCELERATOR_WINDOW_DRY=1 prints the plan.
WINDOW_ARGS = $(if $(WINDOW_OUT),--out $(WINDOW_OUT)) \
  $(if $(WINDOW_BUDGET),--budget $(WINDOW_BUDGET)) \
  $(if $(WINDOW_PARTS),--parts $(WINDOW_PARTS))

accelerator-window: $(STAMP)
	@if [ -z "$$ACCELERATOR_WINDOW_DRY" ] && command -v nvidia-smi >/dev/null 2>&1 \
	  && nvidia-smi -L >/dev/null 2>&1 \
	  && [ "$$($(PY) -c 'import jax; print(jax.default_backend())' 2>/dev/null)" = cpu ]; \
	then $(MAKE) cuda; fi
	$(PY) -m curvbench.bench window $(WINDOW_ARGS)

# An earlier commit against the working tree, side by side in one process.
bench-against: $(STAMP)
	$(if $(REF),,$(error give the commit: make bench-against REF=HEAD~1))
	$(PY) -m curvbench.bench against $(REF)

clean-venv:
	rm -rf $(VENV)
