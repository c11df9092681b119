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

# The default suite under TensorFlow, and at the same time the layer and model
# tests under JAX (two processes: most of a test run is single-threaded tracing,
# so the two share the 2 cores well). The JAX output is printed after the
# TensorFlow run; either failing fails the target. Under JAX, decoding is
# checked on random-weight models only; the trained-model parity tests run
# under TensorFlow.
JAX_DECODING = not trained_model and not greedy_scores and not better_scores and not loaded_model and not trained and not one_by_one
JAX_TESTS = tests/layers tests/test_model.py tests/test_training.py tests/test_decoding.py

test: $(STAMP)
	@TF_CPP_MIN_LOG_LEVEL=2 KERAS_BACKEND=jax $(BIN)/python -m pytest -q -p no:cacheprovider \
		--basetemp=.pytest-jax-tmp $(JAX_TESTS) -k "$(JAX_DECODING)" > .jax-tests.log 2>&1 & jax=$$!; \
	TF_CPP_MIN_LOG_LEVEL=2 KERAS_BACKEND=tensorflow $(BIN)/python -m pytest -q; tf=$$?; \
	wait $$jax; jax_status=$$?; \
	echo "== the same tests under KERAS_BACKEND=jax: $(JAX_TESTS) -k \"$(JAX_DECODING)\""; \
	cat .jax-tests.log; \
	test $$tf -eq 0 && test $$jax_status -eq 0

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

slow: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache .pytest-jax-tmp .jax-tests.log
