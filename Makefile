# The two commands of the README (demo, test). Both create .venv and install everything on a fresh machine, at the
# versions in constraints.txt (the set the project tested; `make lock` regenerates it); test also builds the docs
# site in strict mode (tests/test_docs.py), so the set-up installs the docs extra. `make test-latest` runs the suite
# on the newest releases instead, in .venv-latest, so that a new release is met by a command, not by a fresh clone.
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
LOCK := constraints.txt
LATEST := .venv-latest

.PHONY: setup demo test test-latest lock fuzz bench docs docs-serve FORCE
FORCE:

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Rewritten only when the torch request changes, so that torch is reinstalled exactly then.
$(TORCH_SPEC): FORCE | $(BIN)/python
	@echo '$(TORCH) $(TORCH_PIP)' | cmp -s - $@ || echo '$(TORCH) $(TORCH_PIP)' > $@

$(VENV)/.torch: $(TORCH_SPEC)
	$(BIN)/pip uninstall -q -y torch
	$(BIN)/pip install -q -c $(LOCK) $(TORCH_PIP) '$(TORCH)'
	touch $@

$(BIN)/fcaudit: pyproject.toml $(LOCK) $(VENV)/.torch
	$(BIN)/pip install -q -c $(LOCK) -e '.[test,hf,docs]'
	touch $@

setup: $(BIN)/fcaudit

demo: setup
	$(BIN)/fcaudit demo --out $(OUT) $(ARGS)

# The suite spread over every core (pytest-xdist): each test is independent of the others' order and process.
test: setup
	$(BIN)/python -m pytest -n auto $(ARGS)

# The suite on the newest release of every dependency but torch (the pinned TORCH), in a venv of its own; the lock
# check is skipped there (FCAUDIT_UNLOCKED), everything else must pass as in `make test`.
test-latest:
	$(PY) -m venv $(LATEST)
	echo '$(TORCH)' > $(LATEST)/.torch-pin
	$(LATEST)/bin/pip install -q $(TORCH_PIP) '$(TORCH)'
	$(LATEST)/bin/pip install -q -U --upgrade-strategy eager -c $(LATEST)/.torch-pin -e '.[test,hf,docs]'
	FCAUDIT_UNLOCKED=1 $(LATEST)/bin/python -m pytest -n auto $(ARGS)

# Regenerates constraints.txt: every dependency of every extra resolved by uv for this project's machines (CPython
# 3.11, Linux x86_64) with torch at the pinned version. Its CUDA lines only matter to a CUDA build of torch.
lock: | $(BIN)/python
	$(BIN)/pip install -q uv
	echo '$(TORCH)' > $(VENV)/.lock-torch
	$(BIN)/uv pip compile pyproject.toml --extra test --extra hf --extra docs --extra bench --python-version 3.11 \
	  --python-platform x86_64-unknown-linux-gnu --constraint $(VENV)/.lock-torch \
	  --custom-compile-command 'make lock' -o $(LOCK)

# The fuzzing campaign's long run (tests/fuzzing.py): about 10k inputs over the seven input surfaces, each in a
# forked child checked for a traceback, a hang over 60 s, RSS over 2 GB and a write outside its run directory;
# prints the counts per surface and writes what it found to fuzz-out/found.jsonl. ARGS="--workers 1" on a busy machine.
fuzz: setup
	$(BIN)/python tests/fuzzing.py --inputs 10000 --out fuzz-out $(ARGS)

# Runs the benchmarks one after the other and rewrites docs/benchmarks.md (one table, with each run's load).
bench: setup
	$(BIN)/pip install -q -c $(LOCK) -e '.[bench]'
	$(BIN)/python docs/make_benchmarks.py $(ARGS)

# The docs site in site/ (strict: a broken link or API reference fails); docs-serve previews it.
docs: setup
	$(BIN)/mkdocs build --strict

docs-serve: setup
	$(BIN)/mkdocs serve
