# Developer entry points. PYTHON defaults to the project's .venv (what .ci/run builds), else python3.
PYTHON ?= $(shell [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
export TOKENIZERS_PARALLELISM = false

.PHONY: fast test lint ci

# The edit-test loop (under a minute on a 2-core CPU box): pure functions, config, grader, single-process
# engine and decoder. Tests join this tier with @pytest.mark.fast; multi-process ones are marked slow.
fast:
	$(PYTHON) -m pytest -q -m "fast and not slow and not real_model" tests

# What CI runs (.ci/run's pytest command): every test, slow and real-model ones included.
test:
	PYTHONUNBUFFERED=1 $(PYTHON) -m pytest -q -ra tests

# Lint and type check, as in CI (ruff and mypy come with the dev extra; settings in pyproject.toml).
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy

# The whole CI job: fresh install, lint, tests, launcher tests.
ci:
	bash .ci/run
