# The README's two commands. Each bootstraps .venv on a fresh machine.
# torch is pinned to 2.13.0 (the local CPU build): an unpinned torch pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# Empty: launch.py picks runs/NAME from --config (runs/cpu_tiny without one, runs/cpu_moe for
# ARGS="--config configs/cpu_moe.py"), so another config never resumes cpu_tiny's run.
WORKDIR ?=
ARGS ?=

.PHONY: train test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[hf]"
	touch $@

$(TEST_STAMP): pyproject.toml $(RUN_STAMP)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[hf,test]"
	touch $@

train: $(RUN_STAMP)
	$(PY) launch.py $(if $(WORKDIR),--workdir $(WORKDIR)) $(ARGS)

# A test whose worker process dies (XLA:CPU aborting a collective after its 40 s rendezvous
# timeout, not an assertion) runs once more on a fresh worker and is reported as a rerun;
# assertion failures are never rerun. The cause: XLA:CPU runs independent collectives
# concurrently, so two devices can start them in different orders (see dsjax/pipeline/one_f_one_b.py
# `_after`, which orders 1f1b's, and docs/pipeline.md). `--dist worksteal`, not loadfile: xdist
# can put a crashed test back in the queue only under load or worksteal (loadfile reported the
# crash as a failure), and worksteal also splits the longest file over both workers.
test: $(TEST_STAMP)
	$(PY) -m pytest -n 2 --dist worksteal -q --durations=25 --reruns 1 --only-rerun "crashed while running" tests

clean:
	rm -rf runs .pytest_cache
