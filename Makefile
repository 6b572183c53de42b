# The two commands of the quick start: `make up` and `make test`. Everything installs into .venv,
# pinned by constraints.txt, so a fresh machine needs only python3 (3.11) and this repo.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
PROTOS := $(shell find protos/opml -name '*.proto')
SERVICES := $(sort $(dir $(wildcard services/*/pyproject.toml)))
# Each service's contract (client, resource names, topics, event source): what other services depend on
CONTRACTS := $(sort $(dir $(wildcard services/*/contract/pyproject.toml)))
PACKAGES := protos/python libs/common libs/devstack $(CONTRACTS) $(SERVICES)
# C sources of the packages' extension modules: the editable install builds them, so a change re-installs
C_SOURCES := $(shell find services libs -name '*.c')
STAMP := $(VENV)/.installed
# The router's native inference front (services/inference-router/native): C++ on Debian's gRPC, pinned
FRONT := $(VENV)/bin/opml-inference-front
GRPCXX_DEB := libgrpc++-dev=1.51.1-3+b1

.PHONY: install protos check-protos up down test bench clean

install: $(STAMP) protos $(FRONT)
	@# byte-compile the editable packages, as a wheel install does: with PYTHONDONTWRITEBYTECODE set (it is
	@# on these machines) every process, a traced job's tracer included, would compile them from source
	@# at each start (a traced job's CPU included). Up-to-date files are skipped.
	$(PY) -m compileall -q -j 0 protos/python libs/common/src libs/devstack/src $(foreach p,$(CONTRACTS) $(SERVICES),$(p)src) > /dev/null

$(STAMP): constraints.txt $(foreach p,$(PACKAGES),$(p)/pyproject.toml) $(C_SOURCES)
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	@# promtool (Debian's prometheus package) checks every dashboard query in tests/repo
	@command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus)
	@# openssl makes the certificates of the TLS tests (tests/integration/test_grpc_tls.py)
	@command -v openssl >/dev/null || (apt-get update -qq && apt-get install -y -qq openssl)
	@# ip and tc (iproute2) put the fl-coordinator's members on hosts of their own (services/fl-coordinator/tests/test_netns.py)
	@command -v tc >/dev/null || (apt-get update -qq && apt-get install -y -qq iproute2)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip==23.2.1 setuptools==80.9.0 wheel==0.45.1
	$(PIP) grpcio-tools==1.81.1
	$(MAKE) protos
	@# each service twice, plain and with its test extra: pip 23.2 finds no candidate for a package that
	@# another depends on (automl-controller -> job-orchestrator) when it is named only as pkg[test]
	$(PIP) -e protos/python -e libs/common -e 'libs/devstack[test]' $(foreach c,$(CONTRACTS),-e '$(c:/=)') $(foreach s,$(SERVICES),-e '$(s:/=)' -e '$(s:/=)[test]')
	touch $(STAMP)

$(FRONT): services/inference-router/native/front.cc | $(STAMP)
	@dpkg-query -W -f='$${Version}' libgrpc++-dev 2>/dev/null | grep -qx '$(word 2,$(subst =, ,$(GRPCXX_DEB)))' \
		|| (apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ pkg-config $(GRPCXX_DEB))
	g++ -O2 -std=c++17 -Wall -Wextra -Werror -o $@ $< $$(pkg-config --cflags --libs grpc++)

# Python stubs are generated from protos/ (never edited by hand; git ignores them).
protos: protos/python/.generated
protos/python/.generated: $(PROTOS)
	$(PY) scripts/gen_protos.py protos protos/python
	touch $@

# Fails when the generated stubs differ from what protos/ produce now.
check-protos: install
	$(PY) scripts/gen_protos.py protos protos/python --check

up: install
	$(PY) -m opml_devstack.stack up --main-job scripts/main_job.py

down:
	$(PY) -m opml_devstack.stack down

# Two pytest processes (pytest-xdist): most of a test's time is spent waiting on the real services it
# starts, so two fill the two cores; a file's tests stay on one worker (module fixtures, --dist loadfile).
# Files go out as xdist orders them (most tests first: the long one- and two-test integration files
# last). Handing them out in collection order instead (--no-loadscope-reorder: integration first) made
# the run slower, 49:56 against 39:39: the full-scale main jobs of the restart test then ran beside
# the CPU-heavy service tests (automl trials, scorer rebalances) and every one of them slowed down.
# Each worker has its own broker, S3 server and prefixes. `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

bench: install
	for b in bench/[!_]*.py; do $(PY) $$b || exit 1; done

# A full reset of what `make up` made: the stack stopped, its Redis keys (its prefix only: the machine's
# Redis is shared), its services' homes (~/.opml/<service>) and .opml, then what `make install` made.
clean:
	if [ -x $(PY) ]; then $(PY) -m opml_devstack.stack clean; else echo "no $(VENV): the stack's Redis keys and homes are left"; fi
	rm -rf $(VENV) .venv-peers-* protos/python/opml protos/python/.generated .opml
