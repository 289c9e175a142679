# The two commands of the README, and what they need. Everything goes into a virtual environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint clean gpu-check

## make demo: install, generate the shapes data, train ResNet-18 on it (CPU is enough). runs/demo is the demo's own
## run folder: it is cleared first, so that each demo starts anew (train.py refuses to start over a run's checkpoints).
demo: $(VENV)/.installed
	$(BIN)/python -m lit_imagenet.data.synthetic data/shapes
	rm -rf runs/demo
	$(BIN)/python train.py fit --config configs/demo.yaml --trainer.enable_progress_bar false

## make test: install with the test extras, run the test suite, TEST_PROCESSES test files at a time: three on two
## cores, since much of a test's time is spent waiting on the processes it starts (their imports, a SLURM controller).
## Each test process and every process it starts computes on TEST_THREADS threads (OMP_NUM_THREADS): the files run
## side by side, so more threads than that would share the cores they already fill. The tests' folders (runs,
## checkpoints, generated images) are made in memory, under /dev/shm where it exists: the runs save and sync many
## checkpoints. A passing test's folder is removed when it ends; a failing test's is kept there, and the run says where.
TEST_PROCESSES ?= 3
TEST_THREADS ?= 1
test: $(VENV)/.installed-test
	tmp=$$(mktemp -d /dev/shm/lit_imagenet_tests.XXXXXX 2>/dev/null || mktemp -d); \
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile --durations=15 \
		--basetemp "$$tmp"; status=$$?; \
	if [ $$status -eq 0 ]; then rm -rf "$$tmp"; else echo "The failing tests' folders are under $$tmp"; fi; \
	exit $$status

## make gpu-check: on a GPU machine with the package's requirements installed: GPU tests, fits, throughput
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py

lint: $(VENV)/.installed-test
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: setup.cfg pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: setup.cfg pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(VENV)/.installed $@

clean:
	rm -rf runs data/shapes .pytest_cache
