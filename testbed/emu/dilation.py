"""Choosing the time-dilation factor T for an emulated run.

With factor T, bandwidths are divided by T and delays, compute and load times
multiplied by T; reported times are divided by T. T must be large enough that
all workers' CPU work for one emulated second fits in the host's cores with
headroom, so queues are the model's and not the host's: that is the bound
used here. Kernels run eagerly when a hidden state arrives, so a kernel longer
than its modeled service time (the paper's w/F is microseconds per token)
delays only releases that fall while it runs; that lateness is measured per
run and reported, not hidden by an enormous T. A spec can fix T
(``emu.dilation``).
"""

from __future__ import annotations

import math
import os


#: CPU seconds all workers spend per emulated token-layer (routing, frames,
#: kernels, bookkeeping), measured on this project's workers (README, "Emulator").
CPU_PER_TOKEN_LAYER_S = 1.1e-3
TARGET_UTILISATION = 0.4
#: Floor on T from latency, not throughput: each layer costs a few ms of wall time in
#: routing, framing and event-loop hops, which divide by T. On paper10/Mixtral at
#: 10 req/s, T=16 (the CPU bound) measured a mean 22% above T=32, and T=32 agreed
#: with the simulator within 5% (README, "Emulator against simulator").
MIN_DILATION = 32.0
#: With quality.inrun each hop also runs the proxy (attention, gate, scoring): measured on
#: paper10/Mixtral at 10 req/s, worker CPU 0.92 -> 1.20 ms per token-layer (+0.28 ms; 0.4
#: ms keeps a margin, as the 1.1 ms above does) and the mean latency 15% above the same
#: run without it at T=32, equal to it at T=64 (README).
INRUN_CPU_PER_TOKEN_LAYER_S = 0.4e-3
INRUN_MIN_DILATION = 64.0


def cpu_bound_dilation(rate_per_s: float, tokens_per_request: float, n_layers: int,
                       cpu_per_token_layer_s: float = CPU_PER_TOKEN_LAYER_S) -> int:
    """T at which the workers' CPU work per emulated second fits the cores at the target use."""
    tl_per_s = rate_per_s * tokens_per_request * n_layers
    return math.ceil(tl_per_s * cpu_per_token_layer_s / ((os.cpu_count() or 1) * TARGET_UTILISATION))


def choose_dilation(setup) -> tuple[float, str]:
    reqs = setup.spec.workload.fixed_tokens() is None and getattr(setup, "requests", None)
    tokens = sum(r.prompt_tokens + r.gen_tokens for r in reqs) / len(reqs) if reqs else None
    return dilation_for(setup.spec, setup.shape.n_layers, tokens)


def dilation_for(spec, n_layers: int, tokens_per_request: float | None = None) -> tuple[float, str]:
    """T for ``spec`` (and why): the spec's own, else the CPU bound or the latency floor.
    ``tokens_per_request``: the run's mean where a request trace sets the lengths (default:
    the spec's fixed prompt + generated tokens)."""
    if spec.emu.dilation != "auto":
        return float(spec.emu.dilation), "set in the spec"
    w = spec.workload
    tokens = w.prompt_tokens + w.gen_tokens if tokens_per_request is None else tokens_per_request
    inrun = bool(spec.quality.inrun)
    per_tl = CPU_PER_TOKEN_LAYER_S + (INRUN_CPU_PER_TOKEN_LAYER_S if inrun else 0.0)
    floor, floor_name = (INRUN_MIN_DILATION, "INRUN_MIN_DILATION") if inrun else \
        (MIN_DILATION, "MIN_DILATION")
    cpu = cpu_bound_dilation(w.rate_per_s, tokens, n_layers, per_tl)
    if cpu <= floor:
        return floor, f"latency floor {floor_name} (CPU bound alone: {cpu})"
    return float(cpu), (f"CPU bound: {w.rate_per_s * tokens * n_layers:.0f} token-layers per "
                        f"emulated second x {per_tl * 1e6:.0f} us of worker CPU each, "
                        f"at {TARGET_UTILISATION:.0%} of {os.cpu_count()} cores")
