# Each target creates .venv and installs the package first; both are idempotent.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint slow clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(BIN)/keras-transformer demo --out runs/demo

# The default suite under TensorFlow, then the layer and model tests under JAX.
# Under JAX, decoding is checked on random-weight models only; the trained-model
# parity tests (a toy model trained first) run under TensorFlow.
JAX_DECODING = not trained_model and not greedy_scores and not better_scores and not loaded_model and not trained and not one_by_one

test: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 KERAS_BACKEND=tensorflow $(BIN)/python -m pytest -q
	TF_CPP_MIN_LOG_LEVEL=2 KERAS_BACKEND=jax $(BIN)/python -m pytest -q tests/layers tests/test_model.py tests/test_training.py tests/test_decoding.py -k "$(JAX_DECODING)"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

slow: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
