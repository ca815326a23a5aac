# Each target makes the environment first if it is missing (.venv, CPU torch 2.13.0).
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.blunb-installed
STUDY ?= quickstart
NPROC ?= 2

.PHONY: env study studies test lint bench clean-env

env: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,notebook]"
	touch $(STAMP)

# The main job: the quick-start study on the CPU (2 ranks, gloo), rendered into results/quickstart/.
# publish True: only this target writes the committed results/<study>/ (the notebook's default is
# results/scratch/<study>/, git-ignored).
study: env
	mkdir -p results/$(STUDY)/run0
	$(PY) -m papermill notebooks/00_quickstart.ipynb results/$(STUDY)/run0/run.ipynb \
		-p study $(STUDY) -p nproc $(NPROC) -p publish True -k python3 --cwd notebooks

# Every study notebook (notebooks/1*.ipynb) headless at its CPU defaults, each executed notebook
# beside its runs in results/scratch/<notebook>/. GPU scale: pass parameters through blunb.study,
# e.g. `python -m blunb.study notebooks/10_clipping.ipynb -p preset 124m -p publish True`.
STUDIES ?= $(sort $(wildcard notebooks/1*.ipynb))
studies: env
	@for nb in $(STUDIES); do \
		echo "== $$nb"; \
		$(PY) -m blunb.study $$nb || exit 1; \
	done

test: env
	$(PY) -m pytest -q

lint: env
	$(PY) -m ruff check blunb tests bench

# GPU benchmarks (run on a CUDA machine; each writes results/bench/<name>.csv).
bench:
	PYTHONPATH=. python3 bench/kernels.py
	PYTHONPATH=. python3 bench/attention.py
	PYTHONPATH=. python3 bench/muon.py

clean-env:
	rm -rf $(VENV)
