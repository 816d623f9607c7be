# `make run` and `make test` do all set-up on a fresh machine: they create the
# virtual environment and install the pinned dependency set if it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test browser bench cuda clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

# The default benchmark: spectra, timing and training on the three small
# problems, then the merged report (reports/quick/report/report.md + figures).
run: $(STAMP)
	$(VENV)/bin/curvbench

test: $(STAMP) browser
	$(PY) -m pytest -n 2 --benchmark-disable -q

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
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,cuda]"
	$(PY) -c "import jax; print('jax sees', jax.devices())"

bench: $(STAMP)
	$(PY) -m pytest tests/benchmarks -p no:xdist --benchmark-only --benchmark-columns=median,iqr,rounds

clean-venv:
	rm -rf $(VENV)
