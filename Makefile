# One entry point for setup, tests, lint and the main job.
# `make test` works on a fresh machine: it creates .venv and installs
# everything first (Horovod is built once, then taken from a wheel cache).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-fresh test-unit test-multiproc check lint train bench clean

install: $(STAMP)

$(STAMP): requirements.txt setup.py pyproject.toml scripts/build_horovod.sh dp_plugin/cli/build_horovod.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	bash scripts/build_horovod.sh $(abspath $(PY))
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Two test processes (pytest-xdist), each test file whole in one of them
# (docs/testing.md says why a file: test_faults.py looks for its own workers),
# the longest files first (tests/conftest.py sorts them; xdist's own order,
# most tests first, would leave the long scheduler files for last).
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
test: install
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The same suite with every rank a fresh interpreter (no warm fork server;
# see docs/testing.md): slower, for what only a fresh process shows.
test-fresh: install
	PATH=$(abspath $(VENV))/bin:$$PATH DP_PLUGIN_TEST_FRESH=1 $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-unit: install
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-multiproc: install
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest tests/multiproc $(PYTEST_ARGS)

check: install
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m dp_plugin check

lint: install
	$(VENV)/bin/ruff check dp_plugin adapters tests examples benchmarks
	bash scripts/typecheck.sh

# The main job: BERT masked-LM pretraining, 2 workers on this machine (see README),
# on the default bucket plan (it spreads the 17 MB of gradients over ~4 buckets).
TRAIN_ARGS ?=
train: install
	PATH=$(abspath $(VENV))/bin:$$PATH OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run \
		--nproc_per_node 2 examples/bert_pretrain.py $(TRAIN_ARGS)

# Every engine at 2 ranks: the all-reduce sweep, and the model shape lists
# fused (copies, views) vs one raw all-reduce vs unfused (one per gradient).
bench: install
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m dp_plugin bench --out bench-out \
		--world-sizes 2 --per-tensor

clean:
	rm -rf $(VENV) build *.egg-info
