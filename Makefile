# trajbus: `make demo` and `make test` work on a fresh machine from nothing.
# They create .venv, install the locked dependencies, fetch the Apache Kafka
# broker artifacts from Maven Central into ~/.cache/trajbus (outside the repo),
# and then run the demo or the test suite.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
UV_VERSION := 0.13.9
STAMP  := $(VENV)/.installed

.PHONY: install broker browser demo test test-unit docs bench clean

# Bytecode is compiled once at install: every worker, gateway and trainer process would otherwise
# compile its imports again wherever bytecode is not written (PYTHONDONTWRITEBYTECODE; verl alone ~10 s).
$(STAMP): pyproject.toml requirements.lock
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "trajbus needs Python 3.11, found " + sys.version' 
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv==$(UV_VERSION)
	$(BIN)/uv pip install --python $(BIN)/python --compile-bytecode -r requirements.lock
	$(BIN)/uv pip install --python $(BIN)/python --no-deps -e .
	touch $(STAMP)

# A script in the folder that holds the checkout (a clone named trajbus/) would import that folder as an
# empty namespace package ("cannot import name ... (unknown location)"). Python imports trajbus as it
# starts, before the script's folder is on sys.path, so the package wins (README.md, "Layout").
FIRST  := $(VENV)/lib/python3.11/site-packages/trajbus-first.pth
$(FIRST): $(STAMP)
	printf '%s\n' 'import sys; exec("try: import trajbus\nexcept Exception: pass")' > $@

install: $(STAMP) $(FIRST)

# Downloads the Kafka broker jars once (cached) so the first test does not pay for it.
broker: install
	$(BIN)/trajbus broker install

# Headless Chromium for the dashboard test (Debian's package; root, else sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || ($(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium)

demo: broker
	$(BIN)/trajbus demo

test: broker browser
	$(BIN)/python -m pytest tests -n 2 --durations=15

# The unit layer alone: pure rules, no broker, no subprocess; seconds.
test-unit: install
	$(BIN)/python -m pytest tests/unit

# The docs site from docs/ (mkdocs.yml), live at http://127.0.0.1:8008 (8000 is the examples' inference server).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8008

bench: broker
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .pytest_cache site
