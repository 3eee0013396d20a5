# Two commands set up a fresh machine: `make run` and `make test`.
# Each creates .venv (Python 3.11+) and installs what it needs on first use.

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
# `make run` installs what running needs: the daemon, the client and its torch and arrow
# adapters. No test tools, no apt-get.
RUN_STAMP := $(VENV)/.run-stamp
# `make test` adds the test toolchain (pytest, moto, playwright, ruff, mypy, ...), the
# failing-disk kit, and (as root, saying so) the Debian packages the tests drive.
STAMP  := $(VENV)/.installed-stamp
# Ray (the extra chunkd[ray], ~285 MB) is the test toolchain's only: `make run` never pulls it.
RAY_STAMP := $(VENV)/.ray-stamp
# The Azure Blob emulator the backend suite runs az:// against, and s3rver, the S3
# server the cold-read bench reads over a shaped link (npm, project-local).
AZURITE_VERSION ?= 3.35.0
S3RVER_VERSION ?= 3.7.1
EMULATORS := .emulators
AZURITE := $(EMULATORS)/node_modules/.bin/azurite-blob
S3RVER := $(EMULATORS)/node_modules/.bin/s3rver

.PHONY: run test lint typecheck pytest bench clean emulators tools build-deps prometheus

$(RUN_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch exactly so: a CPU build lies on this disk; any other spec pulls gigabytes
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[daemon,client,arrow,torch]'
	@touch $(RUN_STAMP)

$(STAMP): pyproject.toml $(RUN_STAMP) | build-deps
	$(BIN)/python -m pip install --quiet -e '.[daemon,client,arrow,torch,dev]'
	# The failing-disk kit (pyfuse3) builds against libfuse 3; without it those tests skip.
	$(BIN)/python -m pip install --quiet -e '.[faultyfs]' || \
		echo "pyfuse3 did not build (it needs libfuse3-dev and pkg-config): the failing-disk tests will skip"
	@touch $(STAMP)

# Azurite for the az:// tests; without npm they skip and say why.
$(AZURITE): Makefile
	@if command -v npm >/dev/null; then \
		mkdir -p $(EMULATORS) && \
		npm install --silent --no-audit --no-fund --prefix $(EMULATORS) azurite@$(AZURITE_VERSION) && \
		touch $(AZURITE); \
	else echo "npm not found: the az:// backend tests will skip (install Node.js to run them)"; fi

$(S3RVER): Makefile
	@if command -v npm >/dev/null; then \
		mkdir -p $(EMULATORS) && \
		npm install --silent --no-audit --no-fund --prefix $(EMULATORS) s3rver@$(S3RVER_VERSION) && \
		touch $(S3RVER); \
	else echo "npm not found: the cold-read bench falls back to moto (install Node.js for s3rver)"; fi

emulators: $(AZURITE) $(S3RVER)

## run: the daemon on its embedded default (./chunkd-data, ./chunkd-cache, 127.0.0.1:8470)
run: $(RUN_STAMP)
	$(BIN)/chunkd serve

## test: ruff, mypy (strict on the package) and the whole pytest suite
test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP) $(RAY_STAMP) emulators tools prometheus
	$(BIN)/pytest

# The bulk jobs' tests run a two-node Ray cluster (tests/test_ray_bulk.py).
$(RAY_STAMP): pyproject.toml $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[ray]'
	@touch $(RAY_STAMP)

# What the page and terminal tests drive: Debian's chromium, tmux, ffmpeg (media fixtures),
# the AWS CLI and curl (the S3 front's client and presigned-URL tests), as COMMAND:PACKAGE.
# Installed with apt-get when missing and we are root; otherwise those tests skip, saying why.
# fusermount3 (fuse3) mounts and unmounts the failing-disk tests' FUSE file system; nft
# (nftables) drops and partitions the network-chaos tests' links.
TOOLS := chromium:chromium tmux:tmux ffmpeg:ffmpeg aws:awscli curl:curl fusermount3:fuse3 nft:nftables nginx:nginx-light
tools:
	@missing=""; for t in $(TOOLS); do command -v $${t%%:*} >/dev/null || missing="$$missing $${t#*:}"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "make test: installing with apt-get:$$missing"; \
			apt-get $(APT_WAIT) update -qq && DEBIAN_FRONTEND=noninteractive apt-get $(APT_WAIT) install -y -qq$$missing >/dev/null; \
		else echo "not installed:$$missing (the tests that need them will skip)"; fi; \
	fi

# Debian's Prometheus (2.42, with promtool) for tests/test_prometheus.py, installed like
# TOOLS when missing and we are root. The package ships a service that would listen on
# :9090 on every interface: a policy-rc.d that answers 101 ("not allowed") keeps the
# install from starting any service, no recommended packages (prometheus-node-exporter
# would bring a service of its own), and where systemd runs, the unit is disabled and
# stopped at once. The tests run their own prometheus on 127.0.0.1, at a free port.
# Without it they skip, saying why.
# Our policy-rc.d carries POLICY_RC_MARK: only a file without it (an admin's) is saved,
# as POLICY_RC.chunkd-saved, and a trap puts it back (and removes ours) however the
# shell ends: apt-get done or failed, Ctrl-C, a cancelled CI job (INT, TERM, HUP; a
# second signal, as make sends its children on TERM, is ignored while it restores). A run
# killed with -9 leaves ours behind: the next run knows it by the mark, so it never
# saves ours over the admin's, and puts theirs back. An admin's policy-rc.d beside a
# saved one is left alone (nothing installed: which to keep is the admin's call).
# tests/test_prometheus.py runs this recipe with apt-get shimmed (POLICY_RC elsewhere).
PROMETHEUS_BIN ?= prometheus
POLICY_RC ?= /usr/sbin/policy-rc.d
POLICY_RC_MARK := chunkd make prometheus: temporary, removed after the install
# make -j test runs the tools and prometheus installs at once: wait for dpkg's lock
APT_WAIT := -o DPkg::Lock::Timeout=60
prometheus:
	@if command -v $(PROMETHEUS_BIN) >/dev/null && command -v promtool >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		rc='$(POLICY_RC)'; saved="$$rc.chunkd-saved"; \
		ours() { grep -qsF '$(POLICY_RC_MARK)' "$$rc"; }; \
		if [ -e "$$rc" ] && [ -e "$$saved" ] && ! ours; then \
			echo "not installing prometheus: both $$rc and $$saved exist, keep the one you want (tests/test_prometheus.py will skip)"; \
			exit 0; fi; \
		restore() { trap '' INT TERM HUP; if ours; then rm -f "$$rc"; fi; \
			if [ -e "$$saved" ] && [ ! -e "$$rc" ]; then mv "$$saved" "$$rc"; fi; }; \
		trap restore EXIT; trap "trap '' INT TERM HUP; exit 130" INT TERM HUP; \
		if [ -e "$$rc" ] && ! ours; then mv "$$rc" "$$saved"; fi; \
		printf '#!/bin/sh\n# %s\nexit 101\n' '$(POLICY_RC_MARK)' > "$$rc" && chmod 755 "$$rc"; \
		echo "make test: installing with apt-get: prometheus (its service kept stopped)"; \
		apt-get $(APT_WAIT) update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get $(APT_WAIT) install -y -qq --no-install-recommends prometheus >/dev/null; \
		status=$$?; \
		if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then \
			systemctl disable --now prometheus >/dev/null 2>&1 || true; fi; \
		[ $$status = 0 ] || echo "apt-get could not install prometheus: tests/test_prometheus.py will skip"; \
	else echo "not installed: prometheus (tests/test_prometheus.py will skip)"; fi

# What pip builds a test dependency against, as FILE:PACKAGE (pyfuse3: libfuse 3's
# headers, found with pkg-config); installed like TOOLS, before the venv.
BUILD_DEPS := /usr/include/fuse3/fuse.h:libfuse3-dev /usr/bin/pkg-config:pkg-config
build-deps:
	@missing=""; for t in $(BUILD_DEPS); do test -e $${t%%:*} || missing="$$missing $${t#*:}"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "make test: installing with apt-get:$$missing (to build pyfuse3)"; \
			apt-get $(APT_WAIT) update -qq && DEBIAN_FRONTEND=noninteractive apt-get $(APT_WAIT) install -y -qq$$missing >/dev/null; \
		else echo "not installed:$$missing (pyfuse3 will not build; the failing-disk tests will skip)"; fi; \
	fi

## bench: every benchmark, side by side with the baselines; report in bench/out/latest/ (one folder a run under bench/out/runs/)
bench: $(STAMP) emulators
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) $(EMULATORS) build *.egg-info .mypy_cache .ruff_cache .pytest_cache chunkd-cache
