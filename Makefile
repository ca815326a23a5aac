# Each target makes the environment first if it is missing (.venv: the CPU torch, then blunb[dev,notebook]).
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.blunb-installed
STUDY ?= quickstart
NPROC ?= 2
# torch goes in first, from TORCH_INDEX alone: on Linux PyPI's torch is the multi-GB CUDA build, the
# CPU index has only CPU builds. A GPU machine passes its CUDA index instead, e.g.
# `make env TORCH_INDEX=https://download.pytorch.org/whl/cu130`; the triton that build brings is kept.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: env check-env study studies lab test lint bench bench-speed clean-env

env: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# --retries 2: a machine that cannot reach TORCH_INDEX (its pip configuration serving torch locally) falls
	# through to its own index in ~1 s a package instead of pip's default 5 retries with backoff (~75 s in all).
	$(PY) -m pip install -q --retries 2 --index-url $(TORCH_INDEX) "torch==$(TORCH_VERSION)"
	# torch named again: the one just installed satisfies it, and a TORCH_VERSION outside blunb's range
	# stops here with a conflict rather than pip swapping in PyPI's (CUDA) torch.
	$(PY) -m pip install -q -e ".[dev,notebook]" "torch==$(TORCH_VERSION)"
	touch $(STAMP)

# How a stock machine resolves blunb's two install paths, this machine's pip configuration switched
# off: the CPU path (environment.yml, the CPU index) and the CUDA path (PyPI's torch, with the triton it
# pins). `pip install --dry-run`: nothing is downloaded beyond metadata; an unreachable index skips.
check-env: env
	$(PY) -m pytest -q -rs -p no:cacheprovider -m 'network or not network' tests/test_env.py

# The main job: the quick-start study on the CPU (2 ranks, gloo), rendered into results/quickstart/.
# publish True: only this target writes the committed results/<study>/ (the notebook's default is
# results/scratch/<study>/, git-ignored).
study: env
	mkdir -p results/$(STUDY)/run0
	$(PY) -m papermill notebooks/00_quickstart.ipynb results/$(STUDY)/run0/run.ipynb \
		-p study $(STUDY) -p nproc $(NPROC) -p publish True -k python3 --cwd notebooks

# Every study notebook (notebooks/1*.ipynb) headless at its CPU defaults: the executed notebook goes to
# results/scratch/<notebook>.ipynb, its runs and tables to results/scratch/<study>/. GPU scale: pass
# parameters through blunb.study,
# e.g. `python -m blunb.study notebooks/10_clipping.ipynb -p preset 124m -p publish True`.
STUDIES ?= $(sort $(wildcard notebooks/1*.ipynb))
studies: env
	@for nb in $(STUDIES); do \
		echo "== $$nb"; \
		$(PY) -m blunb.study $$nb || exit 1; \
	done

# JupyterLab from the project's environment (the notebooks' kernel is this venv's python). Jupyter
# refuses to run as root without --allow-root: added only for root.
LAB_ARGS ?=
lab: env
	$(PY) -m jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

test: env
	$(PY) -m pytest -q

lint: env
	$(PY) -m ruff check blunb tests bench

# GPU benchmarks (run on a CUDA machine; each writes results/bench/<name>.csv).
bench:
	PYTHONPATH=. python3 bench/kernels.py
	PYTHONPATH=. python3 bench/attention.py
	PYTHONPATH=. python3 bench/muon.py

# The speed issue's same-run comparison (one GPU, ~15 min): the trainer vs a plain torch.compile'd
# Llama with both sides' profiles, then each fused kernel at the 1b preset's real shapes.
bench-speed:
	PYTHONPATH=. python3 bench/speed.py --presets 1b,124m --out results/bench/speed.csv
	PYTHONPATH=. python3 bench/kernels.py --preset 1b --out results/bench/kernels_1b.csv
	PYTHONPATH=. python3 bench/activation_memory.py --preset 1b --out results/bench/activation_memory_1b.csv
	# Muon vs AdamW at the 1b preset's real global batch (32 micro-batches per optimizer step)
	PYTHONPATH=. python3 bench/speed.py --presets 1b --baselines none --steps 4 --warmup 2 --profile-steps 0 \
		--blunb adamw-batch524k=optimizer=adamw,compile=true,model.chunked_ce=true,global_batch=524288,val_tokens=16384 \
		--blunb muon-batch524k=optimizer=muon,compile=true,model.chunked_ce=true,global_batch=524288,val_tokens=16384 \
		--out results/bench/speed_1b_batch524k.csv

clean-env:
	rm -rf $(VENV)
