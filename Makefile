# Two commands are all a fresh machine needs:  `make train`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
WORKDIR ?= runs/tiny

.PHONY: venv train test lint clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

## Train the tiny default config on the embedded corpus (CPU, progress bar).
train: venv
	$(PY) train.py --config=configs/tiny.py --workdir=$(WORKDIR)

## Lint, then run the whole test suite.
test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 -q

clean:
	rm -rf $(VENV) runs *.egg-info
