# The two entry points of the README: `make train` and `make test`.
# Both build .venv from nothing with pip, under constraints.txt (torch pinned
# to the CPU build found on this machine's disk), with every package under
# packages/ installed editable.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := $(sort $(wildcard packages/*))
STAMP := $(VENV)/.installed

.PHONY: venv train test lint format clean

venv: $(STAMP)

$(STAMP): constraints.txt requirements-dev.txt $(foreach p,$(PACKAGES),$(p)/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch
	$(BIN)/python -m pip install --quiet -c constraints.txt -r requirements-dev.txt \
		$(foreach p,$(PACKAGES),-e $(p))
	touch $(STAMP)

train: venv
	$(BIN)/europa train

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The suite's total and its 30 slowest tests end every run's output (CI's log included):
# where the time goes, issue by issue.
test: lint
	$(BIN)/python -m pytest --durations=30

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
