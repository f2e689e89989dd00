# `make demo` and `make test` set themselves up on a fresh machine: a .venv, torch pinned to the
# CPU build first (a looser requirement can pull several GB of CUDA packages), then this package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spmd-expand train

test: $(STAMP)
	$(PY) -m pytest -q --durations=20 tests

bench: $(STAMP)
	$(PY) bench/expand_speed.py > bench/results/expand_speed.json
	$(PY) bench/fsdp_memory.py > bench/results/fsdp_memory.json
	$(PY) bench/activation_memory.py > bench/results/activation_memory.json
	$(PY) bench/step_time.py > bench/results/step_time.json
	$(PY) bench/call_overhead.py > bench/results/call_overhead.json

clean:
	rm -rf $(VENV) build *.egg-info
