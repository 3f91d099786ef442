# The two commands a newcomer needs:
#   make run   - install everything into .venv and start a single node with embedded defaults,
#                on 127.0.0.1 only
#   make test  - install everything into .venv and run the whole test suite (what CI runs)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test lint bench vs-redis clean

$(STAMP): pyproject.toml setup.py native/narad_native.c native/build_native.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: install
	NARAD_HTTP_HOST=127.0.0.1 $(BIN)/narad-supervisor --data-dir data

lint: install
	$(BIN)/ruff check narad tests loadtest native

test: install lint
	@# the network-partition chaos test drops a node's packets with iptables (in a namespace it makes)
	command -v iptables >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables) \
	    || echo "iptables could not be installed: the partition test will skip"
	@# promtool checks and unit-tests config/monitoring's alert rules (tests/test_monitoring.py)
	command -v promtool >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
	    || echo "promtool could not be installed: the promtool tests will skip"
	@# two processes side by side (pytest-xdist; one file stays in one process, so its
	@# module-scoped node is shared), then the tests marked serial alone
	$(BIN)/pytest -q -n 2 --dist loadfile -m "not serial"
	$(BIN)/pytest -q -m serial

bench: install
	command -v wrk >/dev/null || (apt-get install -y wrk || sudo apt-get install -y wrk)
	$(BIN)/python loadtest/bench_meta.py
	$(BIN)/python loadtest/bench_hop.py
	$(BIN)/python loadtest/bench.py

vs-redis: install
	@# our node, then Redis 7 Streams (appendfsync always), same load generator, back to back
	$(BIN)/python loadtest/vs_redis.py --sittings 1

clean:
	rm -rf $(VENV) build *.egg-info narad/_native*.so
