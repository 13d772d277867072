# Two commands from a fresh clone: `make test` and `make serve`.
# The CPU build of torch is installed before the project so that pip never resolves an unpinned, CUDA-bundled torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# Triton as on the device machine (torch 2.11 ships 3.6): the SM120 gate compiles with its ptxas.
TRITON_SPEC ?= triton==3.6.0
STAMP := $(VENV)/.installed

.PHONY: install test lint serve clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "$(TRITON_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

serve: $(STAMP)
	$(VENV)/bin/hybrid-serve

clean:
	rm -rf $(VENV) build *.egg-info
