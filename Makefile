# Every target installs what it needs into .venv first, so each works on a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Loopback-only Ray: no usage stats, no external address, no cloud-metadata probe.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export http_proxy := http://127.0.0.1:9
export HTTP_PROXY := http://127.0.0.1:9
export no_proxy := 127.0.0.1,localhost,::1
export NO_PROXY := 127.0.0.1,localhost,::1
export MASTER_ADDR := 127.0.0.1

.PHONY: install test test-all test-fast demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build from local disk first; a looser spec would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Two xdist workers, scheduled by tests/scheduling.py: the suite's processes wait on each other's start-up
# often enough that a 2-core machine runs two tests at once with time to spare.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not extended" --durations=30 tests

# Everything, the extended cases too (tests marked extended: see pyproject.toml).
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --durations=30 tests

# The unit tier: tests/unit less the tests marked slow (those start a process that imports torch or Ray: a gloo
# world, the CLI, a script), so nothing here spawns a world, starts Ray or runs the CLI in a subprocess.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests/unit

# The demo's corpus: this repository's own docs and sources, byte-level (configs/gpt-tiny-text.yaml reads it).
DEMO_TEXT := README.md $(wildcard docs/*.md hybrid/*.py hybrid/*/*.py hybrid/*/*/*.py launch/*.py launch/*/*.py)

demo: $(STAMP)
	rm -rf runs/demo  # the demo trains from scratch; `hybrid launch` alone resumes
	@echo "hybrid data prepare README.md docs/ hybrid/ launch/ sources --out runs/demo-corpus/corpus.bin"
	@$(BIN)/hybrid data prepare $(DEMO_TEXT) --out runs/demo-corpus/corpus.bin
	$(BIN)/hybrid launch clusters/local.yaml

$(VENV)/.bench-installed: $(STAMP)
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e ".[bench]"
	touch $@

bench: $(VENV)/.bench-installed
	DS_ACCELERATOR=cpu $(BIN)/python bench/compare.py

clean:
	rm -rf $(VENV) .pytest_cache runs
