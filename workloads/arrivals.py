"""Arrival processes beyond the paper's Poisson, and request lengths from a trace.

The paper gives a rate (Sec. VI-A) and nothing else, so the testbed's requests are a
Poisson process of fixed-length requests (``workloads.requests.generate_requests``).
Serving traffic is burstier than that and its lengths vary by orders of magnitude
(BurstGPT, Wang et al., arXiv:2401.17644; the Azure LLM inference traces of Splitwise,
Patel et al., ISCA 2024). ``make_requests`` adds, behind the same ``Request`` list:

- ``gamma``: arrivals whose gaps are Gamma distributed with a coefficient of variation
  ``cv`` (shape 1/cv^2, as Vidur's Gamma interval generator); cv = 1 is exponential, cv >
  1 comes in bursts. Two ways to draw them (``gamma_count``):

  * ``window`` (the default): the run gets the Poisson run's own requests (the same count,
    users, homes and tasks, drawn as ``generate_requests`` draws them), and only their
    times change: n + 1 Gamma gaps, scaled to span the window (``window_gamma_arrivals``).
    At cv = 1 this is the Poisson process's own law given its count. A comparison with
    Poisson then differs in burstiness alone.
  * ``renewal``: the renewal process itself, as Vidur draws it: gaps of mean 1/rate until
    the window ends. Its request count over a short window varies far more than Poisson's
    (cv 4, 10 req/s, 4 s: standard deviation 0.52 of the mean against 0.15), and a seed's
    gaps at any rate are the same draws scaled, so a seed that draws a light load draws it
    at every rate: the first bursty sweep's three seeds got 12 / 39 / 19 requests at 10
    req/s (40 expected) and 97 / 112 / 67 at 40 (160), and read as faster than Poisson
    (README, "Bursty arrivals"). It suits windows of many mean gaps, or many seeds.
- ``trace``: a recorded request trace's arrivals (``workloads.request_trace``), with
  every gap scaled so that the trace's mean rate is the spec's (its bursts keep their
  shape), or as recorded;
- lengths from a trace: each request takes a trace row's prompt and generated tokens
  (the row it arrived as, or the rows in order, cycled), optionally capped.

Poisson arrivals of fixed lengths are drawn by ``generate_requests`` itself, so every run
made before this module existed keeps its requests. Users, homes and tasks are drawn the
same way for every process. Nothing here is read by a placement (Algorithm 1 sees only the
calibration traffic), which is why the placement key's code hash leaves this module out
(``testbed.setup._code_version``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .request_trace import RequestTrace
from .requests import (_ARRIVAL_TAG, _TASK_DRAW_TAG, Request, RequestShape, Users, draw_tasks,
                       generate_requests)
from .traces import CALIBRATION_ID_BASE

ARRIVALS = ("poisson", "gamma", "trace")
LENGTHS = ("fixed", "trace")
TRACE_RATES = ("spec", "recorded")
GAMMA_COUNTS = ("window", "renewal")
_GAMMA_TAG = 0x6A77  # the window mode's gaps: a stream of their own (the users stay Poisson's)


def gamma_arrivals(rate_per_s: float, cv: float, rng: np.random.Generator,
                   duration_s: float | None = None, n_requests: int | None = None) -> np.ndarray:
    """Sorted arrival times (s) of a Gamma renewal process started at 0: gaps of mean
    1/rate and coefficient of variation ``cv`` (shape 1/cv^2). Exactly one of
    ``duration_s`` and ``n_requests``."""
    if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise ValueError("rate_per_s must be positive and finite")
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError("cv must be positive and finite")
    if (duration_s is None) == (n_requests is None):
        raise ValueError("give exactly one of duration_s and n_requests")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate_per_s * shape)
    if n_requests is not None:
        if n_requests < 0:
            raise ValueError("n_requests must be >= 0")
        return np.cumsum(rng.gamma(shape, scale, size=int(n_requests)))
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError("duration_s must be positive and finite")
    chunk = int(rate_per_s * duration_s * 1.2) + 16
    times = np.cumsum(rng.gamma(shape, scale, size=chunk))
    while times[-1] < duration_s:  # a run of short gaps used the chunk up: draw on
        times = np.concatenate([times, times[-1] + np.cumsum(rng.gamma(shape, scale, size=chunk))])
    return times[: int(np.searchsorted(times, duration_s, side="left"))]


def window_gamma_arrivals(n: int, duration_s: float, cv: float,
                          rng: np.random.Generator) -> np.ndarray:
    """``n`` sorted arrival times in [0, duration_s): the cumulative sums of n + 1 Gamma
    gaps (shape 1/cv^2) scaled so that all n + 1 span the window. The gaps are then a
    Dirichlet(1/cv^2, ...) split of the window; at cv = 1 the times are n uniform order
    statistics, which is how ``poisson_arrivals`` draws a Poisson process given its count."""
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError("cv must be positive and finite")
    if not (duration_s > 0 and math.isfinite(duration_s)) or n < 0:
        raise ValueError("need duration_s > 0 and n >= 0")
    gaps = rng.gamma(1.0 / (cv * cv), 1.0, size=int(n) + 1)
    total = gaps.sum()
    if not total > 0:  # every gap underflowed (cv in the hundreds): all at the window's middle
        return np.full(int(n), duration_s / 2)
    return np.cumsum(gaps[:-1]) * (duration_s / total)


def trace_arrivals(trace: RequestTrace, rate_per_s: float, trace_rate: str = "spec",
                   start_s: float = 0.0, duration_s: float | None = None,
                   n_requests: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(arrival times, trace rows) of a recorded trace's requests from ``start_s`` seconds
    into the recording on: as recorded (``trace_rate`` 'recorded') or with every gap scaled
    so that the trace's mean rate becomes ``rate_per_s`` ('spec'). Exactly one of
    ``duration_s`` and ``n_requests``; a trace that ends first gives what it has."""
    if trace_rate not in TRACE_RATES:
        raise ValueError(f"trace_rate must be one of {TRACE_RATES}")
    if (duration_s is None) == (n_requests is None):
        raise ValueError("give exactly one of duration_s and n_requests")
    first = int(np.searchsorted(trace.arrival_s, start_s, side="left"))
    rows = np.arange(first, trace.n)
    t = trace.arrival_s[first:] - start_s
    if trace_rate == "spec":
        if trace.mean_rate_per_s <= 0:
            raise ValueError(f"{trace.path}: one request, or all at one instant: no rate to "
                             "rescale (trace_rate: recorded replays it as it is)")
        t = t * (trace.mean_rate_per_s / rate_per_s)
    keep = (int(np.searchsorted(t, duration_s, side="left")) if n_requests is None
            else min(int(n_requests), t.size))
    return t[:keep], rows[:keep]


def make_requests(rate_per_s: float, shape: RequestShape, users: Users, seed: int,
                  duration_s: float | None = None, n_requests: int | None = None, *,
                  arrivals: str = "poisson", cv: float = 1.0, gamma_count: str = "window",
                  trace: RequestTrace | None = None,
                  trace_rate: str = "spec", trace_start_s: float = 0.0, lengths: str = "fixed",
                  max_prompt_tokens: int | None = None,
                  max_gen_tokens: int | None = None) -> list[Request]:
    """The run's requests, ids 0..n-1 in arrival order (see the module's docstring).

    ``arrivals`` 'poisson' with ``lengths`` 'fixed' is ``generate_requests`` exactly, and
    'gamma' under ``gamma_count`` 'window' is its requests at other times. Under the renewal
    and trace processes the same streams give the users and tasks: the arrival stream's
    draws after the arrivals pick the users, as there, and the tasks come from their own."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {ARRIVALS}")
    if lengths not in LENGTHS:
        raise ValueError(f"lengths must be one of {LENGTHS}")
    if trace is None and (arrivals == "trace" or lengths == "trace"):
        raise ValueError("arrivals or lengths from a trace need a request trace")
    if gamma_count not in GAMMA_COUNTS:
        raise ValueError(f"gamma_count must be one of {GAMMA_COUNTS}")
    rows = None  # the trace row each request arrived as (trace arrivals only)
    if arrivals == "poisson" or (arrivals == "gamma" and gamma_count == "window"):
        # the Poisson run's requests, drawn as every run drew them
        reqs = generate_requests(rate_per_s, shape, users, seed, duration_s=duration_s,
                                 n_requests=n_requests)
        if arrivals == "gamma":  # the same requests at bursty times (a stream of their own)
            if duration_s is None:
                raise ValueError("gamma_count 'window' needs duration_s")
            times = window_gamma_arrivals(len(reqs), duration_s, cv,
                                          np.random.default_rng([seed, _GAMMA_TAG]))
            reqs = [replace(r, arrival_s=float(t)) for r, t in zip(reqs, times)]
    else:
        rng = np.random.default_rng([seed, _ARRIVAL_TAG])
        if arrivals == "gamma":
            times = gamma_arrivals(rate_per_s, cv, rng, duration_s=duration_s,
                                   n_requests=n_requests)
        else:
            times, rows = trace_arrivals(trace, rate_per_s, trace_rate, trace_start_s,
                                         duration_s=duration_s, n_requests=n_requests)
        if len(times) >= CALIBRATION_ID_BASE:
            raise ValueError("too many requests: ids would reach the calibration range")
        who = rng.integers(0, users.n_users, size=len(times))
        homes = users.homes[who]
        tasks = draw_tasks(users.task_probs, homes, np.random.default_rng([seed, _TASK_DRAW_TAG]))
        reqs = [Request(id=i, arrival_s=float(t), user=int(u), home=int(h),
                        prompt_tokens=shape.prompt_tokens, gen_tokens=shape.gen_tokens,
                        task=int(c))
                for i, (t, u, h, c) in enumerate(zip(times, who, homes, tasks))]
    if lengths == "fixed":
        return reqs
    if rows is None:
        rows = np.arange(len(reqs)) % trace.n
    prompt, gen = trace.prompt_tokens[rows], trace.gen_tokens[rows]
    if max_prompt_tokens is not None:
        prompt = np.minimum(prompt, max_prompt_tokens)
    if max_gen_tokens is not None:
        gen = np.minimum(gen, max_gen_tokens)
    return [replace(r, prompt_tokens=int(p), gen_tokens=int(g))
            for r, p, g in zip(reqs, prompt, gen)]
