"""Requests: arrivals, users attached to home servers, request shapes, T_cal.

Everything is a pure function of its seed (``np.random.default_rng([seed,
tag])`` per purpose), so the same experiment spec always yields the same
requests, whatever else ran before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from hetroute.placement.calibration import CalibrationTraffic

from .models import ModelSpec
from .traces import CALIBRATION_ID_BASE, TraceSource

_ARRIVAL_TAG = 0xA441
_USER_TAG = 0x05E4
_HOME_TAG = 0x4043
_CALIB_TAG = 0xCA1
_TASK_MIX_TAG = 0x7A5
_TASK_DRAW_TAG = 0x7A6

#: Default tasks and their specificity (share of experts whose popularity rank a task
#: re-draws, ``TraceParams.task_specificity``). Choices guided by Jiang et al.,
#: arXiv:2401.04088, Sec. 5 / Fig. 7: expert assignment is largely domain-independent
#: except for DM Mathematics, so math moves more experts than prose and code.
DEFAULT_TASKS = ("prose", "math", "code")
DEFAULT_TASK_SPECIFICITY = {"prose": 0.25, "math": 0.75, "code": 0.25}


#: The default request: 36 prompt tokens, the paper's own number (1490 tokens/s at 40
#: requests/s, Sec. VI-B, Fig. 2(f), is ~37 tokens per request), then 32 generated tokens,
#: which keep the input:output token ratio of the public ShareGPT serving benchmark (vLLM
#: PR #18566: 229,711 input and 203,068 generated tokens over 1000 requests, 1.13:1); the
#: paper gives no lengths. Its figures are prompt-only: their specs set gen_tokens 0.
DEFAULT_PROMPT_TOKENS = 36
DEFAULT_GEN_TOKENS = 32


@dataclass(frozen=True)
class RequestShape:
    """Tokens of one request: a prompt, then ``gen_tokens`` decode tokens.

    The prompt is processed in one forward pass (prefill): its tokens are
    independent routing units released together at arrival. Decode tokens are
    released one after another, each when the previous one is done. Latency is
    from arrival to the last token done.

    Default 36 prompt and 32 generated tokens (``DEFAULT_GEN_TOKENS``: real serving
    decodes). ``gen_tokens=0`` is the paper's request: its ~156 ms mean latency and
    300 ms SLA at 40 requests/s are about one pass through the model, a prefill-only
    request (time to first token), not a multi-step decode.
    """

    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    gen_tokens: int = DEFAULT_GEN_TOKENS

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.gen_tokens < 0:
            raise ValueError("a request needs prompt_tokens >= 1 and gen_tokens >= 0")

    @property
    def n_tokens(self) -> int:
        return self.prompt_tokens + self.gen_tokens


def poisson_arrivals(rate_per_s: float, rng: np.random.Generator, duration_s: float | None = None,
                     n_requests: int | None = None) -> np.ndarray:
    """Sorted arrival times (s) of a Poisson process started at 0.

    Give exactly one of ``duration_s`` (all arrivals in [0, duration_s)) or
    ``n_requests`` (the first n arrivals).
    """
    if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise ValueError("rate_per_s must be positive and finite")
    if (duration_s is None) == (n_requests is None):
        raise ValueError("give exactly one of duration_s and n_requests")
    if n_requests is not None:
        if n_requests < 0:
            raise ValueError("n_requests must be >= 0")
        return np.cumsum(rng.exponential(1.0 / rate_per_s, size=int(n_requests)))
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError("duration_s must be positive and finite")
    n = rng.poisson(rate_per_s * duration_s)
    return np.sort(rng.uniform(0.0, duration_s, size=n))


def zipf_probs(n: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """P(item) proportional to rank^-s over a random permutation of n items."""
    w = np.arange(1, n + 1, dtype=float) ** -float(s)
    probs = np.empty(n)
    probs[rng.permutation(n)] = w / w.sum()
    return probs


@dataclass(frozen=True)
class Users:
    """U users, each attached to one home server (a_u of Sec. III-A).

    Homes are drawn from a Zipf(``zipf_s``) distribution over a seeded
    permutation of servers: the paper attaches users "following a non-uniform
    spatial distribution" (Sec. VI-A) without saying which, and edge demand is
    typically concentrated at a few hot sites. Default s = 1 is our choice: on
    10 servers the hottest server gets ~34% of users and the coldest ~3%.
    Requests come from users uniformly, so a server's load follows its users.

    Tasks: each home server has its own task mix ``task_probs[n]`` over
    ``n_tasks`` tasks: an explicit matrix ``task_mix`` (one row per server, each
    summing to 1), or a seeded Dirichlet(``task_concentration``) draw per server
    (lower concentration: more distinct homes; our default 0.5 is a choice, edge
    sites serving different communities). One task gives every home the same mix.
    """

    n_users: int
    n_servers: int
    zipf_s: float = 1.0
    seed: int = 0
    n_tasks: int = 1
    task_concentration: float = 0.5
    task_mix: tuple[tuple[float, ...], ...] | None = None
    server_probs: np.ndarray = field(init=False, repr=False, compare=False)
    homes: np.ndarray = field(init=False, repr=False, compare=False)
    task_probs: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n_users < 1 or self.n_servers < 1:
            raise ValueError("need at least one user and one server")
        if not (self.zipf_s >= 0 and math.isfinite(self.zipf_s)):
            raise ValueError("zipf_s must be >= 0 and finite")
        probs = zipf_probs(self.n_servers, self.zipf_s, np.random.default_rng([self.seed, _HOME_TAG]))
        homes = np.random.default_rng([self.seed, _USER_TAG]).choice(
            self.n_servers, size=self.n_users, p=probs)
        probs.setflags(write=False)
        homes.setflags(write=False)
        object.__setattr__(self, "server_probs", probs)
        object.__setattr__(self, "homes", homes)
        object.__setattr__(self, "task_probs", task_mix_matrix(
            self.n_servers, self.n_tasks, self.task_concentration, self.task_mix, self.seed))

    def home_probs(self) -> np.ndarray:
        """Share of requests homed at each server (users are picked uniformly)."""
        return np.bincount(self.homes, minlength=self.n_servers) / self.n_users


def task_mix_matrix(n_servers: int, n_tasks: int, concentration: float = 0.5,
                    explicit: Sequence[Sequence[float]] | None = None, seed: int = 0) -> np.ndarray:
    """(n_servers, n_tasks) task mix per home: ``explicit`` rows, or seeded Dirichlet draws."""
    if n_tasks < 1:
        raise ValueError("n_tasks must be >= 1")
    if explicit is not None:
        mix = np.asarray(explicit, dtype=float)
        if mix.shape != (n_servers, n_tasks):
            raise ValueError(f"task_mix must be {n_servers} rows of {n_tasks} shares, got {mix.shape}")
        if np.any(mix < 0) or not np.allclose(mix.sum(axis=1), 1.0, atol=1e-6):
            raise ValueError("task_mix rows must be non-negative and sum to 1")
        mix = mix / mix.sum(axis=1, keepdims=True)
    elif n_tasks == 1:
        mix = np.ones((n_servers, 1))
    else:
        if not (concentration > 0 and math.isfinite(concentration)):
            raise ValueError("task_concentration must be positive and finite")
        mix = np.random.default_rng([seed, _TASK_MIX_TAG]).dirichlet(
            np.full(n_tasks, float(concentration)), size=n_servers)
    mix.setflags(write=False)
    return mix


def draw_tasks(task_probs: np.ndarray, homes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One task per home, drawn from that home's row of ``task_probs``."""
    homes = np.asarray(homes, dtype=np.int64)
    if task_probs.shape[1] == 1:
        return np.zeros(len(homes), dtype=np.int64)
    cum = np.cumsum(task_probs[homes], axis=1)
    u = rng.random(len(homes))[:, None]
    return np.minimum((u >= cum).sum(axis=1), task_probs.shape[1] - 1).astype(np.int64)


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request; ``id`` also names its routing in the trace source."""

    id: int
    arrival_s: float
    user: int
    home: int
    prompt_tokens: int
    gen_tokens: int
    task: int = 0  # index into the workload's tasks; routes by that task's popularity

    @property
    def n_tokens(self) -> int:
        return self.prompt_tokens + self.gen_tokens


def generate_requests(rate_per_s: float, shape: RequestShape, users: Users, seed: int,
                      duration_s: float | None = None, n_requests: int | None = None) -> list[Request]:
    """Poisson arrivals from uniformly chosen users; ids 0..n-1 in arrival order.

    Ids stay below ``CALIBRATION_ID_BASE``, so evaluation routing never reuses
    calibration routing. Each request's task is drawn from its home's task mix
    (``users.task_probs``) on a stream of its own, so arrivals and users do not
    depend on the tasks.
    """
    rng = np.random.default_rng([seed, _ARRIVAL_TAG])
    times = poisson_arrivals(rate_per_s, rng, duration_s=duration_s, n_requests=n_requests)
    if len(times) >= CALIBRATION_ID_BASE:
        raise ValueError("too many requests: ids would reach the calibration range")
    who = rng.integers(0, users.n_users, size=len(times))
    homes = users.homes[who]
    tasks = draw_tasks(users.task_probs, homes, np.random.default_rng([seed, _TASK_DRAW_TAG]))
    return [Request(id=i, arrival_s=float(t), user=int(u), home=int(h),
                    prompt_tokens=shape.prompt_tokens, gen_tokens=shape.gen_tokens, task=int(c))
            for i, (t, u, h, c) in enumerate(zip(times, who, homes, tasks))]


def calibration_traffic(trace: TraceSource, model: ModelSpec, home_probs: np.ndarray,
                        n_tokens: int, seed: int,
                        tokens_per_request: int = DEFAULT_PROMPT_TOKENS,
                        task_probs: np.ndarray | None = None) -> CalibrationTraffic:
    """Held-out T_cal: ``n_tokens`` tokens with home servers and GLOBAL expert ids.

    Tokens come in requests of ``tokens_per_request`` (the default prompt
    length) with ids CALIBRATION_ID_BASE + i, disjoint from every evaluation
    request id (0 .. n-1), so the statistics match while the tokens differ.
    Every token of a calibration request shares its home, drawn from
    ``home_probs`` (e.g. ``Users.home_probs()``). With ``task_probs`` (e.g.
    ``Users.task_probs``), each calibration request's task is drawn from its
    home's mix, so every placement profiles the same task mix as the run.
    """
    probs = np.asarray(home_probs, dtype=float)
    if probs.ndim != 1 or probs.size == 0 or np.any(probs < 0) or not math.isclose(probs.sum(), 1.0, abs_tol=1e-6):
        raise ValueError("home_probs must be a non-negative vector summing to 1")
    if n_tokens < 1 or tokens_per_request < 1:
        raise ValueError("n_tokens and tokens_per_request must be >= 1")
    n_req = -(-n_tokens // tokens_per_request)
    rng = np.random.default_rng([seed, _CALIB_TAG])
    homes_per_req = rng.choice(probs.size, size=n_req, p=probs / probs.sum())
    if task_probs is None:
        blocks = [trace.route(CALIBRATION_ID_BASE + i, tokens_per_request).experts for i in range(n_req)]
    else:
        mix = np.asarray(task_probs, dtype=float)
        if mix.ndim != 2 or mix.shape[0] != probs.size:
            raise ValueError("task_probs must have one row per home server")
        tasks = draw_tasks(mix, homes_per_req, rng)
        blocks = [trace.route(CALIBRATION_ID_BASE + i, tokens_per_request, int(c)).experts
                  for i, c in enumerate(tasks)]
    local = np.concatenate(blocks)[:n_tokens]
    offsets = np.arange(model.n_layers, dtype=np.int64)[None, :, None] * model.experts_per_layer
    homes = np.repeat(homes_per_req, tokens_per_request)[:n_tokens]
    return CalibrationTraffic(homes=homes.astype(np.int64), targets=local + offsets)
