"""Experiment specs: one validated, typed config per run.

A spec is YAML; every field has a default, so the smallest spec is
``router: {name: hetroute}``. Loading never shows a traceback for a bad file:
``load_spec`` raises ``SpecError`` with one line naming the field. The fully
resolved spec (defaults filled in) is written next to every result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from topologies.schema import InputFileError, one_line, read_yaml
from workloads.requests import DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS


#: Requests one run may generate (rate x duration); beyond it the request list alone
#: takes gigabytes, so a typo such as duration_s: 1e12 stops here with one line.
MAX_REQUESTS = 2_000_000
#: workload fields left out of a resolved spec while at their default: at it they give the
#: requests of every run made before they existed, so those runs' ``spec.resolved.yaml``
#: still equal a spec that does not set them (``runner.is_done``: sweeps skip them)
OMITTED_AT_DEFAULT = {"arrivals": "poisson", "arrival_cv": 1.0, "gamma_count": "window",
                      "requests_file": None,
                      "trace_rate": "spec", "trace_start_s": 0.0, "lengths": "fixed",
                      "max_prompt_tokens": None, "max_gen_tokens": None}
#: the same for other sections' fields: section -> field -> default
OMITTED_ELSEWHERE = {"engine": {"load_overlap": "serial", "kv_overflow": "none"},
                     "sim": {"hop_jitter_draw": 0}}


def world_engine(physics: str, attention: str | None = None) -> dict[str, str]:
    """The engine rules a world picks where a spec leaves them out: the hardware world's
    attention is causal, its K/V news come from the request's home (a protocol a worker can
    run); the paper's world is per token (README, "A token's attention needs its request's
    earlier positions")."""
    att = attention or ("causal" if physics == "hardware" else "independent")
    return {"attention": att, "kv_news": "home" if att == "causal" else "instant"}


class SpecError(ValueError):
    """A spec that does not load; the message is one line."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GeneratedTopology(_Model):
    servers: int = Field(ge=1, le=1000)
    seed: int = 0


class WorkloadSpec(_Model):
    model: str = "mixtral-8x7b"
    top_k: int | None = Field(None, ge=1, le=256, description="override the model's top-k (Fig. 5)")
    rate_per_s: float = Field(40.0, gt=0, le=100_000, description="Poisson arrival rate (paper default 40)")
    duration_s: float = Field(10.0, gt=0, le=86_400, description="arrivals stop after this time")
    warmup_s: float = Field(1.0, ge=0, description="requests arriving earlier are not measured")
    prompt_tokens: int = Field(DEFAULT_PROMPT_TOKENS, ge=1, le=131_072, description="tokens "
                               "of the prompt, one pass (36: the paper's 1490 tokens/s at 40 req/s)")
    gen_tokens: int = Field(DEFAULT_GEN_TOKENS, ge=0, le=131_072, description="tokens generated "
                            "after the prompt, one step each; 0: prompt only, as the paper's figures")
    """Default 32 with the 36-token prompt: real serving decodes (issue 13), and 36:32 keeps
    the input:output ratio of the public ShareGPT serving benchmark (vLLM PR #18566:
    229,711 input and 203,068 generated tokens over 1000 requests, 1.13:1); the paper gives
    no lengths. Its figures are one forward pass per request (156 ms mean, 300 ms SLA at
    40 req/s), so every spec reproducing one pins ``gen_tokens: 0``."""
    arrivals: Literal["poisson", "gamma", "trace"] = Field(
        "poisson", description="arrival process: 'poisson' (the paper's), 'gamma' (Gamma gaps "
        "of coefficient of variation arrival_cv, above 1 bursty; see gamma_count) or 'trace' "
        "(requests_file's arrivals)")
    arrival_cv: float = Field(1.0, gt=0, le=100, description="arrivals 'gamma': coefficient "
                              "of variation of the gaps between arrivals (1: exponential)")
    gamma_count: Literal["window", "renewal"] = Field(
        "window", description="arrivals 'gamma': 'window' keeps the Poisson run's requests "
        "(count, users, tasks) and spreads them over the window with Gamma gaps (burstiness "
        "alone); 'renewal' draws the renewal process itself (Vidur's), whose request "
        "count over a short window varies far more than Poisson's at high cv")
    requests_file: str | None = Field(
        None, description="a request trace (CSV with a header: Azure LLM inference "
        "'TIMESTAMP,ContextTokens,GeneratedTokens', BurstGPT 'Timestamp,...,Request tokens,"
        "Response tokens' or 'arrival_s,prompt_tokens,gen_tokens'), read for arrivals: trace "
        "and/or lengths: trace")
    trace_rate: Literal["spec", "recorded"] = Field(
        "spec", description="arrivals 'trace': 'spec' scales every gap so the trace's mean "
        "rate is rate_per_s (its bursts keep their shape); 'recorded' replays its timestamps")
    trace_start_s: float = Field(0.0, ge=0, le=1e9, description="arrivals 'trace': seconds "
                                 "into the recording where the run's arrivals begin")
    lengths: Literal["fixed", "trace"] = Field(
        "fixed", description="request lengths: 'fixed' (prompt_tokens, gen_tokens) or 'trace' "
        "(each request a row of requests_file: the one it arrived as, else rows in order)")
    max_prompt_tokens: int | None = Field(None, ge=1, le=131_072, description="lengths 'trace': "
                                          "cap on a request's prompt tokens")
    max_gen_tokens: int | None = Field(None, ge=0, le=131_072, description="lengths 'trace': "
                                       "cap on a request's generated tokens")
    users: int = Field(100, ge=1, le=10_000_000)
    zipf_s: float = Field(1.0, ge=0, le=10, description="skew of users over home servers")
    trace: str = Field("synthetic", description="'synthetic', a JSON-lines trace file, 'proxy' (the "
                       "measured proxy's held-out trace) or 'auto' (proxy where it exists)")
    trace_params: dict[str, Any] | None = None
    calibration_tokens: int = Field(512, ge=1, le=1_000_000)
    tasks: list[str] = Field(default_factory=lambda: ["prose", "math", "code"], min_length=1,
                             max_length=64, description="request tasks, each with its own expert "
                             "popularity in the synthetic trace; one task: no task locality")
    task_concentration: float = Field(0.5, gt=0, le=1e6, description="Dirichlet concentration of "
                                      "each home server's task mix (lower: homes differ more)")
    task_mix: list[list[float]] | None = Field(None, description="explicit task mix, one row per "
                                               "server (topology order), each summing to 1")
    task_specificity: float | list[float] | None = Field(
        None, description="per task (or one for all): share of experts whose popularity rank the "
        "task re-draws, in [0, 1]; default by name (prose/code 0.25, math 0.75, others 0.5)")

    @model_validator(mode="after")
    def _tasks_valid(self) -> "WorkloadSpec":
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError("tasks must be distinct names")
        spec = self.task_specificity
        values = spec if isinstance(spec, list) else ([] if spec is None else [spec])
        if any(not 0.0 <= v <= 1.0 for v in values):
            raise ValueError("task_specificity must be in [0, 1]")
        if isinstance(spec, list) and len(spec) != len(self.tasks):
            raise ValueError(f"task_specificity lists {len(spec)} values for {len(self.tasks)} tasks")
        if self.task_mix is not None:
            for row in self.task_mix:
                if len(row) != len(self.tasks) or any(v < 0 for v in row) or abs(sum(row) - 1) > 1e-6:
                    raise ValueError(f"task_mix rows need {len(self.tasks)} non-negative shares "
                                     "summing to 1")
        return self

    def task_trace_params(self) -> dict[str, Any]:
        """The task knobs of the synthetic trace (``TraceParams`` overrides)."""
        from workloads.requests import DEFAULT_TASK_SPECIFICITY

        spec = self.task_specificity
        if spec is None:
            spec = [DEFAULT_TASK_SPECIFICITY.get(name, 0.5) for name in self.tasks]
        return {"n_tasks": len(self.tasks),
                "task_specificity": tuple(spec) if isinstance(spec, list) else float(spec)}

    @model_validator(mode="after")
    def _request_source(self) -> "WorkloadSpec":
        """A field of one arrival process or length source set under another does nothing:
        refused, so a spec never silently runs what it did not ask for."""
        uses_file = self.arrivals == "trace" or self.lengths == "trace"
        if uses_file and not self.requests_file:
            raise ValueError("arrivals: trace and lengths: trace read requests_file; give one")
        if self.requests_file and not uses_file:
            raise ValueError("requests_file is read only with arrivals: trace or lengths: trace")
        if self.arrivals != "gamma" and (self.arrival_cv != 1.0 or self.gamma_count != "window"):
            raise ValueError("arrival_cv and gamma_count apply to arrivals: gamma only")
        if self.arrivals != "trace" and (self.trace_rate != "spec" or self.trace_start_s):
            raise ValueError("trace_rate and trace_start_s apply to arrivals: trace only")
        if self.lengths != "trace" and (self.max_prompt_tokens is not None
                                        or self.max_gen_tokens is not None):
            raise ValueError("max_prompt_tokens and max_gen_tokens apply to lengths: trace only")
        return self

    def fixed_tokens(self) -> int | None:
        """Tokens of every request (prompt + generated), or None where a trace sets them."""
        return None if self.lengths == "trace" else self.prompt_tokens + self.gen_tokens

    @model_validator(mode="after")
    def _warmup_inside(self) -> "WorkloadSpec":
        if self.warmup_s >= self.duration_s:
            raise ValueError("warmup_s must be shorter than duration_s")
        expected = self.rate_per_s * self.duration_s
        if expected > MAX_REQUESTS:
            raise ValueError(f"rate_per_s x duration_s = {expected:.3g} requests; at most "
                             f"{MAX_REQUESTS:,} per run (split the run)")
        return self


class QualitySpec(_Model):
    budget: float = Field(0.02, ge=0, le=1, description="per-token Lambda_max (0.02 = 2%)")
    profile: str = Field("prior", description="'prior', a profile file (.npz), 'measured' (the "
                         "proxy profile of `make quality-profile`) or 'auto' (measured where it exists)")
    replay: bool | Literal["auto"] = Field("auto", description="replay the run on the proxy for "
                                           "measured quality (quality.json); auto: on a proxy "
                                           "trace, where a request fits one trace segment (36 tokens)")
    inrun: bool = Field(False, description="emulator only: workers run the proxy's real hidden "
                        "states and trained experts during the run (quality_inrun.csv); needs a "
                        "proxy trace and at most 36 tokens per request")


class MemorySpec(_Model):
    gpu_share: float = Field(0.9, ge=0, le=1, description="share of G_n for experts + dense weights")
    cpu_share: float = Field(0.9, gt=0, le=1)


class RouterSpec(_Model):
    name: str = "hetroute"
    params: dict[str, Any] = Field(default_factory=dict)


class SimSpec(_Model):
    payload_efficiency: float = Field(
        0.956, gt=0, le=1, description="TCP/IP goodput share of link rate (1448/1514 B)")
    header_bytes: int = Field(64, ge=0, le=1 << 20, description="framing bytes per message")
    hop_jitter_s: float = Field(0.0, ge=0, le=1.0, description="mean of an exponential extra "
                                "delay per message that crosses a link (seeded): a sensitivity "
                                "probe for the emulator's per-hop wall cost, not a physical term")
    #: one seed's trajectory under jitter is one draw of a chaotic system (README, "Where the
    #: exact simulator's seeds read high": four draws of 1 us read 0.850-0.951 of the exact
    #: runs of twelve seeds at one point), so ``agree-null --draws`` runs several
    hop_jitter_draw: int = Field(0, ge=0, le=10_000, description="which draw of the hop "
                                 "jitter: 0 seeds it with the run's seed (every run before the "
                                 "field existed), k > 0 with (seed, k); needs hop_jitter_s > 0")

    @model_validator(mode="after")
    def _draw_needs_jitter(self) -> "SimSpec":
        if self.hop_jitter_draw and not self.hop_jitter_s:
            raise ValueError("hop_jitter_draw needs hop_jitter_s > 0 (it picks a draw of the jitter)")
        return self


class EmuSpec(_Model):
    dilation: Annotated[float, Field(ge=1, le=10_000)] | Literal["auto"] = Field(
        "auto", description="time dilation T >= 1 (emulated time runs T times slower than wall "
        "time); 'auto' picks it from the workload (testbed/emu/dilation.py)")
    delay_mechanism: Literal["auto", "netem", "transport"] = Field(
        "auto", description="per-pair delay: netem where the kernel has it, else in the transport")
    cpu_fraction: Annotated[float, Field(gt=0, le=1)] | Literal["auto"] = Field(
        "auto", description="cgroup CPU share of the machine per worker ('auto': one core)")
    expert_d_model: int = Field(64, ge=8, le=16_384, description="hidden size of the emulated experts")
    max_drain_s: float = Field(5.0, gt=0, le=3_600, description="emulated seconds to wait after the last "
                               "arrival; requests unfinished then are recorded as failed")
    late_writes: Literal["absorbed", "exposed"] = Field(
        "absorbed", description="a data frame its sender wrote late (wall seconds after its model "
        "send time, its own Python per hop): 'absorbed' starts the transport delay line at the "
        "due time, so the lateness is hidden where the link's dilated delay covers it; "
        "'exposed' starts it at the frame's arrival (before 2026-11-29). netem: always exposed")
    arrivals: Literal["kernel", "read"] = Field(
        "kernel", description="when a received frame arrived: 'kernel', the kernel's receive "
        "time of its last bytes (SO_TIMESTAMPNS), so a worker busy elsewhere does not delay "
        "what reached it; 'read', when the worker's loop read them (before 2026-12-03)")
    socket_buffer_bytes: int = Field(
        8 << 20, ge=0, le=1 << 30, description="each connection's send and receive buffer, "
        "so that a worker busy with a kernel or a decision neither closes its peers' TCP "
        "window nor idles its own link (testbed/emu/transport.py); 0: the kernel's autotuned "
        "buffers (before 2026-12-03), whose 87 kB start holds 2 ms of a 312 Mbit/s link")


class NetSpec(_Model):
    """How a message crosses a link beyond rate and delay (``testbed/tcp.py``)."""

    #: ``tcp`` since 2026-11-26: Linux's defaults are what a deployment gets unless tuned, and
    #: the window moves the hardware world's latencies by up to 2.3x at low load (README,
    #: "TCP's window"); ``ideal`` was the testbed's rule before and stays available
    transport: Literal["ideal", "tcp"] = Field(
        "tcp", description="'tcp': a message larger than its connection's congestion window "
        "waits a round trip per window (slow start from the initial window, halved per idle "
        "retransmission timeout), in both backends; 'ideal': the window always fills the "
        "pipe. Hardware physics only (the paper's links are ideal)")
    init_cwnd: int = Field(10, ge=1, le=100_000, description="initial window, segments "
                           "(RFC 6928)")
    mss_bytes: int = Field(1448, ge=88, le=65_495, description="TCP payload per segment")
    rto_min_s: float = Field(0.2, gt=0, le=60, description="minimum retransmission timeout "
                             "(Linux TCP_RTO_MIN); a connection idle for round trip + this "
                             "halves its window")
    idle_decay: bool = Field(True, description="net.ipv4.tcp_slow_start_after_idle (Linux "
                             "default 1)")
    #: ``segments`` since 2026-11-27 evening: under ``bursts`` (the default before) a message
    #: that starts just after a burst gets a fresh window with nothing in flight (README, "The
    #: ACK clock"); every TCP-world figure was run again under it
    tcp_model: Literal["bursts", "segments"] = Field(
        "segments", description="'bursts': slow start in flights; a message that starts after "
        "the last byte left begins a new burst with the grown window and nothing in flight; "
        "'segments': the ACK clock segment by segment (a message just after a burst finds its "
        "last flight still unacknowledged)")
    #: 2 since 2026-12-06: the link model had charged no ACKs, and tc counted 8.3% more
    #: bytes than the emulator's workers wrote (README, "ACKs on the reverse link")
    ack_every: int = Field(2, ge=0, le=64, description="segments of data per pure ACK on "
                           "the reverse link (testbed/acks.py; RFC 5681's delayed ACK: 2); "
                           "0: ACKs take no link time (the rule before 2026-12-06). "
                           "Hardware physics only")
    #: ``links`` is the physical rule and the default; ``instant`` is the paper's omniscient
    #: one, kept to measure what it changes (README, "What servers know of each other travels")
    control: Literal["links", "instant"] = Field(
        "links", description="what a server knows of the others. 'links': at its window "
        "tick its view of a peer's backlog is the peer's last window broadcast that crossed "
        "their link by then (one window old or more), and a layer's record reaches the "
        "decider that routed it (HetRoute's feedback, eq. 21) when its frame has crossed the "
        "link; both are header-sized frames that wait behind the hidden states queued on "
        "their link, as the emulator's STATE and FEEDBACK frames do; 'instant': both "
        "at once (the paper's rule). Simulator, hardware physics only; the emulator's "
        "always cross the links")

    def params(self):
        from .tcp import TcpParams

        return TcpParams(self.init_cwnd, self.mss_bytes, self.rto_min_s, self.idle_decay,
                         self.tcp_model)


class EngineSpec(_Model):
    """How each server's stream batches and what a routing decision costs (testbed/steps.py)."""

    max_batch_tokens: int = Field(2048, ge=1, le=1_000_000, description="distinct tokens per "
                                  "step at most (vLLM's max_num_batched_tokens)")
    hold_s: float = Field(0.0, ge=0, le=1.0, description="a step may wait this long after its "
                          "oldest job for more to batch")
    decision_s: Annotated[float, Field(ge=0, le=1)] | Literal["calibrated", "measured"] = Field(
        "calibrated", description="CPU seconds charged per routing decision, by both backends: "
        "'calibrated' (the router's median on calibration tokens, timed at set-up; the run's "
        "resolved spec holds the number), 'measured' "
        "(each decision's own CPU time; not bit-reproducible) or fixed seconds")
    #: ``step`` is what serving engines do: a step's routing is computed for its whole batch
    #: and its hidden states leave as one tensor per destination (a pipeline stage sends the
    #: micro-batch's activations at once; expert parallelism dispatches a step's tokens by
    #: all-to-all). ``token`` was the testbed's rule until 2026-11-26: the first token of a
    #: prompt left alone and started a one-token step at the next server, and the rest queued
    #: behind it, which made pipelines 1.3-1.5x slower and their means move 10-25% with a
    #: 2% change of the decision constant or 50 us of jitter per hop (README, "Dispatch").
    #: ``fused`` is what vLLM/SGLang's fused-MoE kernels pay, measured on an H100 and an H200
    #: (README, "Measured on a real GPU"): the default since 2026-11-27; ``per_expert`` was
    #: the rule of every figure before, and over-charges a step of many small experts (60
    #: Qwen experts of one token: 1.31 ms by the per-expert rule, 0.41 ms measured grouped).
    moe_kernels: Literal["per_expert", "fused"] = Field(
        "fused", description="how a step's experts launch: 'fused' (one set of launches per "
        "precision per step, as grouped-GEMM MoE kernels) or 'per_expert' (each active "
        "replica's FFN launches its own kernels: a loop over experts; the rule before "
        "2026-11-27). Hardware physics only")
    dispatch: Literal["token", "step"] = Field(
        "step", description="'step': the tokens whose dense part ran in one step are decided, "
        "then leave together, one message per destination, and a step's partials to one "
        "aggregator travel as one; 'token': each token leaves when its own decision is done, "
        "one message per token and hop. Hardware physics only (the paper's world is per token)")
    #: written into every hardware-world resolved spec, so a run made before the rule existed
    #: (which had prefetches on a link of their own) is not taken for one made under it
    prefetch_link: Literal["shared", "own"] = Field(
        "shared", description="'shared': a server's prefetches and its steps' loads use one "
        "copy engine (since 2026-12-05); 'own': prefetches on a link of their own and a "
        "step's load in the stream, the rule before (only prefetching routers, MoE-Infinity, "
        "differ). Hardware physics only")
    #: ``serial`` is the rule of every figure; ``copy_engine`` is what an engine that overlaps
    #: host-to-device copies with computation pays (README, "Loads beside kernels").
    load_overlap: Literal["serial", "copy_engine"] = Field(
        "serial", description="where a CPU-resident replica's load v/beta runs: 'serial' (in "
        "the step, before its kernel, holding the stream) or 'copy_engine' (on the server's "
        "copy engine, FIFO with prefetches, while the stream runs the step's other work; a "
        "loaded replica's kernel waits for its copy). Hardware physics only")
    #: ``causal`` is what a forward pass needs (testbed/kv.py) and the hardware world's rule
    #: since 2026-12-08 (before, every figure ran ``independent``); ``independent`` is the
    #: paper's per-token model, the only rule of ``physics: paper``: a token attends wherever it
    #: resides as if its request's earlier positions' K/V were there (``python -m analysis
    #: causal-kv`` measures how often they were not). Left out, the world picks (``world_engine``).
    attention: Literal["independent", "causal"] | None = Field(
        None, description="'causal' (the hardware world's default): a token's dense part of a "
        "layer waits until every earlier position of its request has computed that layer's K/V, "
        "and fetches those computed on other servers (testbed/kv.py); 'independent' (the paper's "
        "per-token model, the only rule of physics: paper): each token's attention runs where "
        "it resides, its request's earlier K/V taken as present. On the emulator causal needs "
        "kv_news: home and no faults")
    #: ``home`` is a protocol a real deployment can run, so the default under causal attention
    #: since 2026-12-08; ``instant`` is the lower bound every causal run before 2026-12-07
    #: (afternoon) used
    kv_news: Literal["instant", "home"] | None = Field(
        None, description="under attention: causal, how a waiting token's server learns "
        "where its request's earlier K/V are: 'home' (the default: a directory at the request's "
        "home: servers report each step's dense parts there, a token asks it and is answered "
        "once it has heard of every earlier position) or 'instant' (at once: a lower bound, "
        "simulator only)")
    #: ``none`` is every figure's rule: the cache grows past the room and the run says so
    #: (``kv_peak_share`` in metrics.json, a warning); ``spill`` holds it to the room
    kv_overflow: Literal["none", "spill"] = Field(
        "none", description="what a server's K/V cache does past its room, (1 - "
        "memory.gpu_share) x G_n: 'none' (it grows on; the run reports and warns) or 'spill' "
        "(the newest requests' K/V sit in host memory and each step that reads them copies them "
        "in over PCIe first; testbed/kv_spill.py). Hardware physics")


class FaultSpec(_Model):
    kind: Literal["kill_worker", "cut_link"]
    at_s: float = Field(ge=0, le=86_400)
    server: str | None = None
    peer: str | None = None


class ExperimentSpec(_Model):
    name: str = "run"
    seed: int = Field(0, ge=0, le=2**32 - 1, description="numpy seeds are 32-bit, non-negative")
    backend: Literal["sim", "emu"] = "sim"
    physics: Literal["hardware", "paper"] = Field(
        "hardware", description="the world's service times: 'hardware' (roofline of each "
        "server's GPU class, per-layer steps, dense part in the stream) or 'paper' (w/F per "
        "token, per-replica batches, dense part as a delay: the world before the hardware model)")
    topology: str | GeneratedTopology = "paper10"
    workload: WorkloadSpec = WorkloadSpec()
    quality: QualitySpec = QualitySpec()
    memory: MemorySpec = MemorySpec()
    router: RouterSpec = RouterSpec()
    window_s: float = Field(0.02, ge=1e-4, le=60, description="scheduling window Delta t")
    sla_s: float = Field(0.3, gt=0, le=3_600, description="SLA target (Fig. 9: 300 ms)")
    sim: SimSpec = SimSpec()
    engine: EngineSpec = EngineSpec()
    net: NetSpec = NetSpec()
    emu: EmuSpec = EmuSpec()
    faults: list[FaultSpec] = Field(default_factory=list)

    #: engine fields the world filled in (left out of the spec): ``with_overrides`` lets a
    #: changed physics pick them again
    _world_filled: tuple[str, ...] = PrivateAttr(default=())

    def __eq__(self, other: object) -> bool:
        """Equal specs are equal settings, however their rules came to be (written or the
        world's pick)."""
        if not isinstance(other, ExperimentSpec):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # a spec holds lists (faults): never hashable

    @model_validator(mode="after")
    def _world_picks(self) -> "ExperimentSpec":
        eng = self.engine
        picked = world_engine(self.physics, eng.attention)
        filled = tuple(k for k in ("attention", "kv_news") if getattr(eng, k) is None)
        if filled:
            object.__setattr__(self, "engine", eng.model_copy(update={k: picked[k] for k in filled}))
            self._world_filled = filled
        return self

    @model_validator(mode="after")
    def _overlap_needs_steps(self) -> "ExperimentSpec":
        if self.engine.load_overlap != "serial" and self.physics != "hardware":
            raise ValueError("engine.load_overlap: 'copy_engine' needs physics: hardware (the "
                             "paper's world runs one replica per step: nothing to overlap)")
        if self.engine.prefetch_link != "shared" and self.physics != "hardware":
            raise ValueError("engine.prefetch_link: 'own' needs physics: hardware (the paper's "
                             "world always gives prefetches a link of their own)")
        if self.engine.attention != "independent" and self.physics != "hardware":
            raise ValueError("engine.attention: 'causal' needs physics: hardware (the paper's "
                             "world has no streams for a token's attention to wait in)")
        if self.engine.attention == "causal" and self.backend == "emu":
            if self.engine.kv_news != "home":
                raise ValueError("engine.attention: 'causal' on backend: emu needs kv_news: "
                                 "'home' (no emulated worker sees where every K/V is, as "
                                 "'instant' does)")
            if self.faults:
                raise ValueError("engine.attention: 'causal' (the hardware world's default) "
                                 "on backend: emu runs without faults (a lost holder's K/V are "
                                 "not recovered yet): set engine.attention: independent for a "
                                 "fault run")
        if self.engine.kv_news != "instant" and self.engine.attention != "causal":
            raise ValueError("engine.kv_news: 'home' needs attention: causal (under "
                             "'independent' no token waits for its request's K/V)")
        if self.engine.kv_overflow != "none":
            if self.physics != "hardware":
                raise ValueError("engine.kv_overflow: 'spill' needs physics: hardware (the "
                                 "paper's world reads no K/V cache)")
        if self.engine.prefetch_link == "own" and self.engine.load_overlap != "serial":
            raise ValueError("engine.prefetch_link: 'own' needs load_overlap: serial (loads "
                             "overlap kernels on the copy engine the prefetches share)")
        return self

    @property
    def tcp_windows(self) -> bool:
        """Whether messages wait for TCP's window (``net.transport: tcp``, hardware world
        only: the paper's links are ideal), in either backend."""
        return self.physics == "hardware" and self.net.transport == "tcp"

    @property
    def ack_bytes_per_byte(self) -> float:
        """ACK bytes the reverse link carries per byte of data (``net.ack_every``; the
        hardware world only: the paper's links are ideal)."""
        from .acks import ack_bytes_per_byte

        if self.physics != "hardware":
            return 0.0
        return ack_bytes_per_byte(self.net.mss_bytes, self.net.ack_every)

    @property
    def control_over_links(self) -> bool:
        """Whether the simulator's views and feedback cross the links (``net.control``)."""
        return self.physics == "hardware" and self.net.control == "links"

    def with_overrides(self, overrides: dict[str, Any]) -> "ExperimentSpec":
        """A copy with dotted-key overrides, e.g. {'workload.rate_per_s': 80}."""
        data = self.model_dump()
        for f in self._world_filled:  # the world (perhaps a new one) picks them again
            if f"engine.{f}" not in overrides:
                data["engine"][f] = None
        for key, value in overrides.items():
            node = data
            parts = key.split(".")
            for p in parts[:-1]:
                if not isinstance(node.get(p), dict):
                    node[p] = {} if node.get(p) is None else node[p]
                    if not isinstance(node[p], dict):
                        raise SpecError(f"override {key}: {p} is not a section")
                node = node[p]
            node[parts[-1]] = value
        return parse_spec(data, "<overrides>")

    def to_yaml(self, full: bool = False) -> str:
        """The spec as YAML; ``full``: every field, ``OMITTED_AT_DEFAULT``'s too (``show-spec``;
        a resolved spec leaves those out at their defaults)."""
        data = self.model_dump(mode="json")
        w = data["workload"]
        for key, default in OMITTED_AT_DEFAULT.items():
            if not full and w.get(key, default) == default:
                w.pop(key, None)
        for section, fields in OMITTED_ELSEWHERE.items():
            for key, default in fields.items():
                if not full and data[section].get(key, default) == default:
                    data[section].pop(key, None)
        if not full and self.physics != "hardware":  # the paper's world has one rule
            data["engine"].pop("prefetch_link", None)
            data["engine"].pop("attention", None)  # per token: its only rule
            data["engine"].pop("kv_news", None)
        elif not full and self.engine.attention == "independent":
            data["engine"].pop("kv_news", None)  # no token waits for K/V: no news
        return yaml.safe_dump(data, sort_keys=False)


def parse_spec(data: object, source: str = "<spec>") -> ExperimentSpec:
    if data is None:
        data = {}
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(one_line(err, source)) from None


def load_spec(path: str | Path) -> ExperimentSpec:
    p = Path(path)
    try:
        data = read_yaml(p, "spec file")
    except InputFileError as err:
        raise SpecError(str(err)) from None
    return parse_spec(data, p.name)


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as YAML (``workload.rate_per_s=80``)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise SpecError(f"override {text!r}: expected key=value")
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError:
        raise SpecError(f"override {text!r}: value is not valid YAML") from None
