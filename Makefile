# Two commands are all a fresh machine needs:  `make train`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
WORKDIR ?= runs/tiny

.PHONY: venv train test constraints clean

# Installs the exact versions of constraints.txt, so a new release of a dependency cannot
# break the two commands overnight (setup.cfg keeps ranges for your own environments).
$(VENV)/.installed: setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

venv: $(VENV)/.installed

## Train the tiny default config on the embedded corpus (CPU, progress bar).
train: venv
	$(PY) train.py --config=configs/tiny.py --workdir=$(WORKDIR)

## Lint, then run the whole test suite.
test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 -q

## Re-pin constraints.txt to the newest releases of every dependency, if the lint and the
## whole suite pass with them (in a separate .venv-refresh; constraints.txt is untouched
## otherwise). Then `make test` reinstalls .venv from the new pins.
constraints:
	rm -rf .venv-refresh
	$(PYTHON) -m venv .venv-refresh
	.venv-refresh/bin/python -m pip install -q --upgrade pip
	.venv-refresh/bin/python -m pip install -q -e '.[test]'
	.venv-refresh/bin/ruff check .
	.venv-refresh/bin/python -m pytest -n 2 -q
	{ sed -n '/^#/p' constraints.txt; .venv-refresh/bin/python -m pip freeze --all \
	    --exclude-editable | grep -v '^setuptools=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf .venv-refresh
	@echo "constraints.txt now pins the releases above; commit it"

clean:
	rm -rf $(VENV) .venv-refresh runs *.egg-info
