# One command for the main job (`make book`; `make book FROM=record` renders the recorded chapters) and one for the
# tests (`make test`).
# Both create and fill .venv/ (requirements/ci.lock: every package pinned with hashes, CPU torch) when it is missing.
# Users with their own environment (e.g. conda with a CUDA torch) pass PYTHON=/path/to/python to skip the venv.
SHELL := /bin/bash
VENV ?= .venv
SCALE ?= cpu
PROFILE ?= default
CONFIG ?=
CHROMIUM ?= /usr/bin/chromium
# FROM=record: `make book` renders the recorded chapters (book/recorded/cpu/) instead of running the workflow;
# BOOK_OUTPUT=D puts that book in D/_build/html instead of _build/html (the tests build it aside).
FROM ?=
BOOK_OUTPUT ?=

ifeq ($(origin PYTHON), undefined)
PYTHON := $(VENV)/bin/python
ENV_READY := $(VENV)/.installed
else
ENV_READY :=
endif

.PHONY: help env lock test test-lib test-cluster book record bench mutation clean

help:
	@echo "make book    run the workflow (workflow/Snakefile): training runs, tables, notebooks and the book in"
	@echo "             _build/html (SCALE=cpu|smoke|full, default cpu; PROFILE=default|slurm;"
	@echo "             CONFIG='seeds=[0] runs=/scratch/runs' overrides config/config.yaml)"
	@echo "make book FROM=record  the book from the recorded chapters (book/recorded/cpu/) in _build/html, in a"
	@echo "             minute: nothing trained or executed (what CI publishes; BOOK_OUTPUT=D builds in D/_build/html)"
	@echo "make record  after a cpu build (make book): record its executed chapters and the tables they read in"
	@echo "             book/recorded/cpu/ (tracked; linked from the README and the book's introduction)"
	@echo "make test-cluster  start a single-node SLURM on localhost (root) and run the smoke grid through it"
	@echo "make test    run the test suite (every tier: tests/ief, tests/companion, tests/book), after the smoke book"
	@echo "make test-lib  the library's tier alone (tests/ief: oracles, routes, guards) without its slow tier (tests"
	@echo "             marked slow: the inductor compile, several processes; make test runs them): the inner loop"
	@echo "make bench   run every benchmark (one thread, niced) into benchmarks/results/*.json and rewrite the"
	@echo "             tables of benchmarks/README.md from them (not part of the tests; minutes on a small CPU)"
	@echo "make env     create .venv/ with the locked CPU install (requirements/ci.lock; VENV=path for another;"
	@echo "             TORCH_INDEX=https://download.pytorch.org/whl/cpu where pip does not find torch 2.13.0+cpu)"
	@echo "make lock    rewrite requirements/ci.lock (hashes) from requirements/ci.txt"
	@echo "make mutation  mutation testing (mutmut) of the core numerical modules against their test files; fails"
	@echo "             under 90 % detected per module (MODULES='ief/kfac.py ...' for some, MUTATION_BUDGET mutants each;"
	@echo "             not part of the tests: ~20-40 min, one core, niced); report in _build/mutation/report.txt"

env: $(ENV_READY)

# TORCH_INDEX (opt-in): a package index holding the locked CPU build of torch (requirements/ci.lock pins
# torch==2.13.0+cpu with its hashes), e.g. make env TORCH_INDEX=https://download.pytorch.org/whl/cpu. PyPI's torch
# wheel is the multi-GB CUDA build, so on a machine whose pip configuration does not already hold the CPU wheel this
# is how the CPU path gets the CPU build. Unset (the default), pip asks only the indexes it is configured with: no
# index is added that could be slow or unreachable (this project's machines find the wheel locally).
TORCH_INDEX ?=
TORCH_INDEX_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

# Every package from requirements/ci.lock (each transitive dependency pinned, with hashes: pip refuses any file whose
# sha256 is not listed), the peer libraries of no-deps.txt and the cpu scale's data/weights of cpu-assets.txt (hashed
# too, without their declared dependencies), then this checkout, editable, built
# with the locked setuptools (no isolated build environment, which would fetch an unpinned one).
$(VENV)/.installed: pyproject.toml companion/pyproject.toml requirements/ci.lock requirements/no-deps.txt \
		requirements/cpu-assets.txt
	@echo "==> creating $(VENV) (the locked CPU install: requirements/ci.lock)"
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --require-hashes $(TORCH_INDEX_ARGS) \
		-r requirements/ci.lock || { echo "make env: if pip found no torch==2.13.0+cpu, rerun with" \
		"make env TORCH_INDEX=https://download.pytorch.org/whl/cpu (PyTorch's CPU wheel index)" >&2; exit 1; }
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --require-hashes --no-deps \
		-r requirements/no-deps.txt -r requirements/cpu-assets.txt
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . -e ./companion
	touch $@

# Rewrite requirements/ci.lock after a change to requirements/ci.txt (the top-level pins): pip-compile, pinned, in a
# throw-away venv. Pins already in the lock are kept where ci.txt allows them; LOCK_ARGS=--upgrade moves them all.
LOCK_TOOLS := _build/lock-tools
LOCK_ARGS ?=
lock:
	python3 -m venv $(LOCK_TOOLS)
	$(LOCK_TOOLS)/bin/python -m pip install -q --disable-pip-version-check pip-tools==7.6.2
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_TOOLS)/bin/pip-compile $(TORCH_INDEX_ARGS) --quiet --generate-hashes --allow-unsafe --no-emit-find-links --no-emit-index-url \
		--no-strip-extras $(LOCK_ARGS) --output-file requirements/ci.lock requirements/ci.txt

# The test command: build the book at smoke scale through the workflow (into _build/smoke, leaving a reader's
# _build/html alone), then run the whole suite, including the browser test of that book, then the smoke evaluation
# again under ATen's default (scalar) CPU kernels, its records compared with the build's (tools/kernels.py states the
# tolerances and why). The suite runs on every core (pytest-xdist; TEST_WORKERS=0 runs it in one process), at most 4
# workers, each test file in one worker (its module fixtures built once), one torch thread per worker (conftest.py).
# IEF_TEST_RUNS: the chapters' tests copy the smoke book's training runs, just made for this code, instead of training
# the same grid again (tests/nbrun.py, train_grid).
TEST_WORKERS ?= auto
test: $(ENV_READY) $(CHROMIUM)
	$(PYTHON) -m tools.book build --scale smoke --output _build/smoke
	IEF_TEST_RUNS=$(CURDIR)/runs $(PYTHON) -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile --durations 30 tests
	$(PYTHON) -m tools.kernels --results results/smoke --runs runs --out _build/smoke/kernels-default

# The library's tier alone (tests/ief): no book, no workflow, no companion; the inner loop of work on ief/. Tests
# marked slow (pyproject.toml's markers: the inductor compile, the tests that start several processes) are left to
# make test; tests/conftest.py refuses a tests/ief test that starts processes without the marker.
test-lib: $(ENV_READY)
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile -m "not slow" tests/ief

# A real SLURM cluster on localhost (needs root; writes /etc/slurm): the smoke grid through workflow/profiles/slurm,
# compared with the same grid run locally.
test-cluster: $(ENV_READY)
	PYTHON=$(abspath $(PYTHON)) bash tools/slurm/test-cluster.sh

$(CHROMIUM):
	@echo "==> installing Debian's chromium for the browser test (needs root: otherwise install it yourself)"
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# The workflow decides what is out of date; an interrupted build resumes where it stopped. FROM=record renders the
# recorded chapters instead (tools/book/record.py): no training, no notebook executed; .github/workflows/book.yml
# publishes that book, and tests/book/test_record.py runs the same command.
book: $(ENV_READY)
ifeq ($(FROM),record)
	$(PYTHON) -m tools.book from-record $(if $(BOOK_OUTPUT),--output $(BOOK_OUTPUT))
else ifeq ($(FROM),)
	$(PYTHON) -m tools.book build --scale $(SCALE) --profile $(PROFILE) $(foreach c,$(CONFIG),--config '$(c)')
else
	@echo "make book: unknown FROM=$(FROM); accepted: FROM=record (the recorded chapters), or none (the workflow)" >&2
	@exit 2
endif

# After a cpu build: its executed chapters and the tables they read into book/recorded/cpu/ (tracked), with the
# commit, the machine and the build's cost; refuses a build older than a chapter's notebook or of uncommitted code.
record: $(ENV_READY)
	$(PYTHON) -m tools.book record

# The commands that wrote the committed benchmarks/results/*.json (each record holds its exact command).
BENCH_RESULTS := benchmarks/results
BENCH := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 $(PYTHON) -m benchmarks
bench: $(ENV_READY)
	$(BENCH).step --repeats 5 --json $(BENCH_RESULTS)/step-cpu.json
	$(BENCH).conv2d --repeats 7 --json $(BENCH_RESULTS)/conv2d-cpu.json
	$(BENCH).damping_sweep --models mlp --m 32,64 --repeats 3 --json $(BENCH_RESULTS)/damping_sweep-cpu.json
	$(BENCH).evaluation --setups digits-mlp --repeats 3 --json $(BENCH_RESULTS)/evaluation-digits-mlp-cpu.json
	$(BENCH).evaluation --setups tweets-minilm-lora --repeats 1 \
		--json $(BENCH_RESULTS)/evaluation-tweets-minilm-lora-cpu.json
	$(BENCH).paper_mlp --cases adam,ief-auto,ief-auto-nocheck --repeats 9 --warmup 1 --memory-steps 2 \
		--json $(BENCH_RESULTS)/paper_mlp-cpu.json
	$(BENCH).distributed --json $(BENCH_RESULTS)/distributed-cpu.json
	$(BENCH).slow_paths --json $(BENCH_RESULTS)/slow_paths-cpu.json
	$(BENCH).gpt2_full --size mini --tokens 64 --repeats 9 --json $(BENCH_RESULTS)/gpt2_full-cpu.json
	$(BENCH).gpt2_full --memory-only --json $(BENCH_RESULTS)/gpt2_full-small-memory-cpu.json
	$(BENCH).hf_layers --repeats 15 --before 52bef0a --json $(BENCH_RESULTS)/hf_layers-52bef0a-cpu.json
	$(BENCH).auto_lr --json $(BENCH_RESULTS)/auto_lr-cpu.json
	$(PYTHON) -m benchmarks.report benchmarks/README.md

# Mutation testing (tools/mutation/run.py): mutmut is installed apart from the project's environment, one worker,
# niced, one thread; survivors that cannot change behaviour are listed, with why, in tools/mutation/equivalent.txt.
MUTATION_SITE := _build/mutation/site
MODULES ?= ief/damping_sweep.py ief/rows.py ief/directions.py ief/curvature.py ief/kfac.py ief/jacobian/ ief/optim/
MUTATION_BUDGET ?= 400
MUTATION_SEED ?= 0
$(MUTATION_SITE)/.installed: requirements/mutation.txt
	$(PYTHON) -m pip install -q --disable-pip-version-check --no-deps --upgrade --target $(MUTATION_SITE) \
		-r requirements/mutation.txt
	touch $@
mutation: $(ENV_READY) $(MUTATION_SITE)/.installed
	PYTHONPATH=$(abspath $(MUTATION_SITE)) OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 19 $(PYTHON) -m tools.mutation.run \
		--modules '$(MODULES)' --budget $(MUTATION_BUDGET) --seed $(MUTATION_SEED)

clean:
	rm -rf _build .pytest_cache .snakemake
