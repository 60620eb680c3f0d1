# One venv in .venv; `make run` is the main job, `make test` the whole suite (CI calls it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install run test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

run: install
	$(BIN)/nebula-engine compare

test: install
	$(BIN)/pytest

bench: install
	$(BIN)/python tools/bench_forward.py
	$(BIN)/python tools/bench_planner.py

clean:
	rm -rf $(VENV) build *.egg-info
