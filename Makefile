# The two commands of the README. Both create .venv and install everything on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
OUT ?= demo-out
# torch: the pinned version; it is the CPU build where pip finds a CPU wheel (as on this project's machines).
# Elsewhere PyPI's Linux wheel is the CUDA build: for the CPU build pass
#   TORCH_PIP="--index-url https://download.pytorch.org/whl/cpu"
# GPU users: make demo TORCH=torch (PyPI's default Linux build). Changing TORCH or TORCH_PIP reinstalls torch.
TORCH ?= torch==2.13.0
TORCH_PIP ?=
TORCH_SPEC := $(VENV)/.torch-spec

.PHONY: setup demo test bench FORCE
FORCE:

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Rewritten only when the torch request changes, so that torch is reinstalled exactly then.
$(TORCH_SPEC): FORCE | $(BIN)/python
	@echo '$(TORCH) $(TORCH_PIP)' | cmp -s - $@ || echo '$(TORCH) $(TORCH_PIP)' > $@

$(VENV)/.torch: $(TORCH_SPEC)
	$(BIN)/pip uninstall -q -y torch
	$(BIN)/pip install -q $(TORCH_PIP) '$(TORCH)'
	touch $@

$(BIN)/fcaudit: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e '.[test,hf]'
	touch $@

setup: $(BIN)/fcaudit

demo: setup
	$(BIN)/fcaudit demo --out $(OUT) $(ARGS)

test: setup
	$(BIN)/python -m pytest $(ARGS)

bench: setup
	$(BIN)/python benchmarks/forward_speed.py --preset demo
	$(BIN)/python benchmarks/train_speed.py --threads 1
	$(BIN)/python benchmarks/audit_floor.py
	$(BIN)/python benchmarks/audit_memory.py
	$(BIN)/python benchmarks/shard_speed.py
	$(BIN)/python benchmarks/moe_penalties.py
