# Each target creates .venv and installs the package first; both are idempotent.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test integration lint slow pretrained clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml runtime/pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e "./runtime[serve]" -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/keras-transformer demo --out runs/demo

# Test tiers, chosen by markers (pyproject.toml): the unit tier on random
# weights (`make test`), the integration tier with trained fixtures, exports
# and commands end to end (`make integration`), and `make slow` (real data,
# long training). `make test` runs the unit tier under TensorFlow and, at the
# same time, the tests marked `jax` under JAX (two processes: most of a test
# run is single-threaded tracing, so the two share the 2 cores well); the JAX
# output is printed after the TensorFlow run, and either failing fails it.
UNIT = not slow and not integration and not pretrained
PYTEST = TF_CPP_MIN_LOG_LEVEL=2 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

test: $(STAMP)
	@KERAS_BACKEND=jax $(PYTEST) --basetemp=.pytest-jax-tmp -m "jax and $(UNIT)" \
		> .jax-tests.log 2>&1 & jax=$$!; \
	KERAS_BACKEND=tensorflow $(PYTEST) -m "$(UNIT)" --doctest-modules tests keras_transformer runtime/keras_transformer_runtime; tf=$$?; \
	wait $$jax; jax_status=$$?; \
	echo "== the tests marked jax, under KERAS_BACKEND=jax"; \
	cat .jax-tests.log; \
	test $$tf -eq 0 && test $$jax_status -eq 0

# The integration tier in two processes as well: the `train` command's tests
# (each trains on the generated corpus) beside the tests on the shared
# trained fixtures; the first's output is printed after the second's.
# TRAIN_LANE_TOO: tests that need no shared fixture, run in the first process
# to even out the two processes' times (on a 2-core Zen 4: 357 s against 265 s
# without these two Marian tests; the lanes vary by 20% from run to run).
# One-process tests only: a test of two processes slows both lanes.
TRAIN_TESTS = tests/train/test_stages.py tests/test_demo.py
TRAIN_LANE_TOO = tests/train/test_streamed.py \
	tests/pretrained/test_marian.py::test_fine_tuning_an_imported_model_changes_weights_keeps_the_tokenizer_and_deploys \
	tests/pretrained/test_marian.py::test_the_marian_shape_benchmark_builds_a_directory_that_imports_and_measures_its_cost
integration: $(STAMP)
	@KERAS_BACKEND=tensorflow $(PYTEST) --basetemp=.pytest-train-tmp -m "integration and not slow" \
		$(TRAIN_TESTS) $(TRAIN_LANE_TOO) > .train-tests.log 2>&1 & train=$$!; \
	KERAS_BACKEND=tensorflow $(PYTEST) -m "integration and not slow" \
		$(addprefix --ignore=,$(TRAIN_TESTS)) $(addprefix --deselect=,$(TRAIN_LANE_TOO)); rest=$$?; \
	wait $$train; train_status=$$?; \
	echo "== $(TRAIN_TESTS) and $(words $(TRAIN_LANE_TOO)) more"; \
	cat .train-tests.log; \
	test $$rest -eq 0 && test $$train_status -eq 0

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

slow: $(STAMP)
	$(PYTEST) -m slow

# The Marian import against transformers itself (PyTorch, a large install: not in
# `make test` or CI). `-m "pretrained and not slow"` leaves out the OPUS-MT-size model.
pretrained: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[pretrained-test]"
	$(PYTEST) -m pretrained

clean:
	rm -rf $(VENV) runs .pytest_cache .pytest-jax-tmp .jax-tests.log .pytest-train-tmp .train-tests.log
