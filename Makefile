# One command for the main job (`make book`) and one for the tests (`make test`).
# Both create and fill .venv/ (CPU torch pinned in requirements/ci.txt) when it is missing.
# Users with their own environment (e.g. conda with a CUDA torch) pass PYTHON=/path/to/python to skip the venv.
SHELL := /bin/bash
VENV ?= .venv
SCALE ?= cpu
CHROMIUM ?= /usr/bin/chromium

ifeq ($(origin PYTHON), undefined)
PYTHON := $(VENV)/bin/python
ENV_READY := $(VENV)/.installed
else
ENV_READY :=
endif

.PHONY: help env test book bench clean

help:
	@echo "make book    execute the notebooks (SCALE=cpu|smoke|full, default cpu) and build the book in _build/html"
	@echo "make test    run the test suite"
	@echo "make bench   print speed ratios (benchmarks/, not part of the tests)"
	@echo "make env     create .venv/ with the pinned CPU install"

env: $(ENV_READY)

$(VENV)/.installed: pyproject.toml requirements/ci.txt requirements/no-deps.txt
	@echo "==> creating $(VENV) (pinned CPU install from requirements/ci.txt)"
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements/ci.txt
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/no-deps.txt
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

# The test command: build the book at smoke scale (into _build/smoke, leaving a reader's _build/html alone), then
# run the whole suite, including the browser test of that book.
test: $(ENV_READY) $(CHROMIUM)
	$(PYTHON) -m tools.book --scale smoke --output _build/smoke
	$(PYTHON) -m pytest tests

$(CHROMIUM):
	@echo "==> installing Debian's chromium for the browser test (needs root: otherwise install it yourself)"
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

book: $(ENV_READY)
	$(PYTHON) -m tools.book --scale $(SCALE)

bench: $(ENV_READY)
	$(PYTHON) -m benchmarks.step

clean:
	rm -rf _build .pytest_cache
