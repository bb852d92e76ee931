# splitfire — the two commands a new user needs are `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: setup run test test-fast test-slow lint protos bench clean system-deps constraints image test-image k8s-binaries test-k8s docs docs-serve docs-check

setup: $(STAMP)

# Debian packages: libibverbs for Mooncake, redis-server for session affinity and the tests.
system-deps:
	@need=""; \
	[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || [ -e /usr/lib/aarch64-linux-gnu/libibverbs.so.1 ] || need="$$need libibverbs1 ibverbs-providers"; \
	command -v redis-server >/dev/null || need="$$need redis-server"; \
	if [ -n "$$need" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo ">> apt-get install$$need"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null; \
	  else echo ">> missing system packages:$$need (install them as root; without redis-server the router keeps state in-process)"; fi; \
	fi

$(STAMP): pyproject.toml constraints.txt | system-deps
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_CUDA),1)
	$(PY) -m pip install -q torch triton
	$(PY) -m pip install -q -e '.[test,bench,router,docs,mooncake-cuda]'
else
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench,router,docs,mooncake]'
endif
	@touch $(STAMP)

run: setup
	$(VENV)/bin/splitfire model fetch
	$(VENV)/bin/splitfire up

# Style (ruff), the layers' import contracts (lint-imports: pyproject's [tool.importlinter]),
# types in the torch-free layers (mypy: pyproject's [tool.mypy]), and the benchmark results' index
# (every file in loadtest/results/ indexed and cited by a page, no machine paths).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy
	$(PY) -m loadtest.check_results

# The whole suite, slow SmolLM2 tests included, after the lint and the docs site's strict build.
test: setup lint docs
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The documentation site (MkDocs Material) into site/: --strict, so a broken link, a missing anchor or a
# page left out of the navigation fails; the CLI, metrics and chart-values pages are generated from the code.
docs: setup
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

docs-serve: setup
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

# Opt-in: the built site's home page and a reference page rendered by headless Chromium (Debian's chromium),
# so a broken theme or missing assets are caught. Not part of `make test`.
docs-check: docs
	SPLITFIRE_TEST_DOCS_SITE=1 $(PY) -m pytest -q tests/test_docs_site.py $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

protos: setup
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/splitfire.proto

# The versions in this venv (after a green `make test`) become the ones every CPU install and image gets.
constraints: setup
	@(echo "# The dependency versions CI last tested (make constraints rewrites this from the venv; CPU installs use it)."; \
	  $(PY) -m pip freeze --exclude-editable 2>/dev/null | sort -f) > constraints.txt
	@echo "constraints.txt: $$(grep -c == constraints.txt) pinned"

# The chart's CPU images with podman, no registry (helm/tools/build_image.sh); cached in ~/.cache/splitfire/image.
image: setup
	PY=$(PY) bash helm/tools/build_image.sh

# Kubernetes 1.20's control-plane and node binaries, built once from Debian's source into ~/.cache/splitfire/k8s
# (helm/tools/kube_build.sh: ~6-10 minutes on 2 cores, the build's output shown; a second run returns at once).
k8s-binaries:
	bash helm/tools/kube_build.sh

# Opt-in: the chart on a real Kubernetes 1.20 on this machine (etcd + kube-apiserver, controller-manager,
# scheduler; one node: kubelet, containerd, kube-proxy, CNI bridge, dnsmasq DNS); pods run `make image`'s images.
# Both are built first, as make prerequisites, outside any test's timeout. Not part of `make test`.
test-k8s: setup image k8s-binaries
	SPLITFIRE_TEST_K8S=1 $(PY) -m pytest -q -s tests/test_k8s.py $(PYTEST_ARGS)

# Opt-in: the images under podman (the worker image serves a streamed chat). Not part of `make test`.
test-image: image
	SPLITFIRE_TEST_IMAGE=1 $(PY) -m pytest -q tests/test_image.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info site
