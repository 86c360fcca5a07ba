# HetRoute testbed. `make setup` once, then `make test`, `make experiment FIG=9`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FIG ?= 9
BACKEND ?= emu
SCALE ?= quick
PHYSICS ?= hardware
RESULTS ?= results
FIGURES ?= figures
APT_PACKAGES := mininet iperf3 iptables iproute2 libnetfilter-queue1

.PHONY: setup system-packages venv test test-fast test-timing bench experiment figures report clean-net quality-profile compare clean

## setup: system packages (as root, for the emulator) and the virtual environment
setup: system-packages $(STAMP)

system-packages:
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then echo "installing:$$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; fi; \
	else echo "note: not root or no apt-get; the emulator needs: $(APT_PACKAGES)"; fi

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e '.[test]'
	@touch $(STAMP)

## test: the whole suite (emulation tests skip with a reason where root/Mininet are missing):
## what judges no wall clock runs on two processes (one file per process), then the emulated
## runs and the wall-clock checks run alone, since a busy CPU would fail them
test: $(STAMP)
	$(PYTHON) -m pytest -q -n 2 --dist loadfile -m "not timing and not emu and not serial"
	$(PYTHON) -m pytest -q -m "(emu or serial) and not timing"

## test-fast: the inner loop (method, router contract, simulator) on every core, under a minute here
test-fast: $(STAMP)
	$(PYTHON) -m pytest -q -n auto -m "not slow and not emu and not timing and not serial"

## test-timing: checks that judge real CPU timings (the CPU hardware model); run on a quiet machine
test-timing: $(STAMP)
	$(PYTHON) -m pytest -q -m timing

## bench: routing and simulator speed, written to results/bench.json
bench: $(STAMP)
	$(PYTHON) -m testbed.bench

## experiment: one figure of the paper, e.g. make experiment FIG=9 BACKEND=sim SCALE=smoke PHYSICS=paper
experiment: $(STAMP)
	$(PYTHON) -m testbed sweep --fig $(FIG) --backend $(BACKEND) --scale $(SCALE) --physics $(PHYSICS) --results $(RESULTS)
	$(PYTHON) -m analysis figure --fig $(FIG) --backend $(BACKEND) --scale $(SCALE) --physics $(PHYSICS) --results $(RESULTS) --out $(FIGURES)

figures: $(STAMP)
	$(PYTHON) -m analysis figures --results $(RESULTS) --out $(FIGURES)

report: $(STAMP)
	$(PYTHON) -m analysis report --out $(FIGURES)

## compare: every router on paper10 / Mixtral at the default load (sim)
compare: $(STAMP)
	$(PYTHON) -m testbed compare specs/compare.yaml --set physics=$(PHYSICS) --out $(RESULTS)/compare-$(PHYSICS)

quality-profile: $(STAMP)
	$(PYTHON) -m workloads.proxy profile --all
	for m in switch-base-8 qwen1.5-moe-a2.7b mixtral-8x7b; do \
	  $(PYTHON) -m analysis.quality.surrogate results/quality/$$m --out results/quality/$$m/surrogate.png \
	    --title "$$m proxy: random plans on held-out text" || exit 1; done

## clean-net: remove every namespace, interface, qdisc, rule and cgroup the emulator made
clean-net:
	@if [ -x $(PYTHON) ]; then $(PYTHON) -m testbed.emu.hosts.cleanup; else $(PY) -m testbed.emu.hosts.cleanup; fi

clean:
	rm -rf results/runs results/compare .pytest_cache
