# The two commands of the README. Both create .venv and install everything on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
OUT ?= demo-out
# CPU build from this machine's disk by default; GPU users: make demo TORCH=torch (PyPI's Linux build is CUDA).
TORCH ?= torch==2.13.0

$(BIN)/fcaudit: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: setup demo test bench
setup: $(BIN)/fcaudit

demo: setup
	$(BIN)/fcaudit demo --out $(OUT) $(ARGS)

test: setup
	$(BIN)/python -m pytest $(ARGS)

bench: setup
	$(BIN)/python benchmarks/train_speed.py
	$(BIN)/python benchmarks/audit_speed.py
