# Developer entry points. PYTHON defaults to the project's .venv (what .ci/run builds), else python3.
PYTHON ?= $(shell [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
export TOKENIZERS_PARALLELISM = false

.PHONY: fast test lint ci

# The edit-test loop (under a minute idle on a 2-core CPU box; bench/readme_clocks.py --only make_fast times it):
# pure functions, config, grader, single-process engine and decoder. Tests join this tier with @pytest.mark.fast;
# multi-process ones are marked slow, and a fast-tier test that takes seconds (a subprocess) heavy. It prints its
# own wall time last, so a change that slows the loop is seen.
FAST_MARKS = fast and not slow and not heavy and not real_model
fast:
	@t0=$$(date +%s.%N); rc=0; $(PYTHON) -m pytest -q -m "$(FAST_MARKS)" tests || rc=$$?; \
	echo "make fast: $$(awk "BEGIN {printf \"%.1f\", $$(date +%s.%N) - $$t0}") s wall"; exit $$rc

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
