# The two Quick start commands (`make run`, `make test`) create .venv and install on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
KERAS_STAMP := $(VENV)/.installed-keras
TRITON_STAMP := $(VENV)/.installed-triton
# A Keras user's install, `pip install "relpos[keras]" jax`, beside, with pytest and Hypothesis
# (the keras-test extra): the Keras suite's JAX part runs there, and it must hold no torch.
KERAS_VENV := .venv-keras
KERAS_ONLY_STAMP := $(KERAS_VENV)/.installed
# No wheel cache: a second copy of TensorFlow, JAX and the rest would double the disk it needs.
PIP_INSTALL := $(BIN)/python -m pip install -q --no-cache-dir

.PHONY: run recipe test test-all lint bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -c constraints-cpu.txt -e '.[torch,music,dev]'
	touch $(STAMP)

# Keras 3 and its three backends, for the Keras suite only (`make run` does not need them).
$(KERAS_STAMP): $(STAMP)
	$(PIP_INSTALL) -c constraints-cpu.txt -e '.[keras-dev]'
	touch $(KERAS_STAMP)

$(KERAS_ONLY_STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(KERAS_VENV)
	$(KERAS_VENV)/bin/python -m pip install -q --no-cache-dir --upgrade pip
	$(KERAS_VENV)/bin/python -m pip install -q --no-cache-dir -c constraints-cpu.txt -e '.[keras,keras-test]' jax
	touch $(KERAS_ONLY_STAMP)

# Triton, for the kernels' suite in its interpreter (tests/fused; a CPU needs no other use of it).
$(TRITON_STAMP): $(STAMP)
	$(PIP_INSTALL) -c constraints-cpu.txt -e '.[kernels-dev]'
	touch $(TRITON_STAMP)

run: $(STAMP)
	$(BIN)/relpos demo --run-dir runs/demo

# The JSB recipe (docs/results.md): train (or resume) runs/jsb, evaluate, sample 20 chorales and
# compare them with the test split. The standard split ships with relpos (`--data jsb`).
RECIPE := runs/jsb
recipe: $(STAMP)
	if [ -f $(RECIPE)/last.pt ]; then $(BIN)/relpos train --run-dir $(RECIPE) --resume; \
	else $(BIN)/relpos train --config configs/jsb-music.json --run-dir $(RECIPE); fi
	$(BIN)/relpos eval --run-dir $(RECIPE)
	$(BIN)/relpos generate --run-dir $(RECIPE) --samples 20 --length 128 --stats test --no-progress

# The PyTorch suite, the Keras suite once per backend (jax, tensorflow, torch; the JAX part that
# needs no PyTorch in the Keras user's install, which must hold none) and the Triton kernels'
# suite, side by side, each in its own process (tests/run_suites.py).
test: $(KERAS_STAMP) $(TRITON_STAMP) $(KERAS_ONLY_STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python tests/run_suites.py --durations 10 -- -m "not slow"

# Every test and every case of each matrix (`make test` runs a pairwise cover: tests/matrix.py).
test-all: $(KERAS_STAMP) $(TRITON_STAMP) $(KERAS_ONLY_STAMP)
	$(BIN)/python tests/run_suites.py -- --full-matrix

lint: $(KERAS_STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

clean:
	rm -rf $(VENV) $(KERAS_VENV) build *.egg-info src/*.egg-info
