"""Run traced steps as real kernels: the world's step rule against a GPU on real traffic.

``measure-gpu`` checks the hardware model one kernel shape at a time. What the
simulator charges, though, is steps: a router's traffic decides how many replicas a
step holds, how many tokens each gets, how many requests' dense parts ride along
and at which prompt positions. ``python -m testbed run SPEC --trace-steps`` writes
every step's composition (``testbed.steps.step_row``); ``python -m testbed hardware
replay-steps RUN_DIR --out DIR`` draws a seeded sample of those steps and runs each
on the CUDA GPU at hand as an engine would, beside what the step rule charges for
the same step on that GPU's catalogue class (``testbed.steps.charge``):

- the dense part of the step's tokens: RMSNorm, the QKV projection, the new keys
  and values written into each request's cache, attention of each token over its
  request's positions (``varlen``: one variable-length flash-attention call over the
  packed requests, as engines run it, CUDA only; ``masked``: requests padded to the
  step's longest with a mask, through ``scaled_dot_product_attention``), the output
  projection, RMSNorm, the router and, for Qwen, the shared expert with its gate;
- each CPU-resident replica's weights copied from pinned host memory;
- the experts two ways: ``loop``, each active replica's FFN back to back (against
  the rule with ``per_expert`` launches), and ``grouped``, one ``torch._grouped_mm``
  per matrix over all active replicas in BF16 (against ``fused``).

Every replica is replayed and charged at FP16 whatever precision the trace gave it
(the comparison stays like for like; INT4 kernels are ``measure-gpu``'s ``int4``
part). Expert weights rotate through sets, one per call, enough of them that even a
step of one small expert reads four times the L2 cache per pass (``weight_sets``): a
call reads its weights from DRAM; each step is timed as a CUDA-graph replay (CPU: eagerly) by the same timers
as ``measure-gpu``. Models with self-attention only (Mixtral, Qwen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from hetroute.hardware import HardwareError, gpu_class
from hetroute.service import HardwareService
from hetroute.system import Cluster, Precision

from .gpu_profile import (_attention_layers, _ffn_weights, _randn, _summary, run_ffn,
                          time_calls, time_graph)
from .steps import charge

METHODS = ("loop", "grouped")
ATTENTION = ("varlen", "masked")
RULE_OF = {"loop": "per_expert", "grouped": "fused"}
#: expert weights on the device for the rotation, FP16 and the BF16 stacks together, at most
POOL_BYTES = 32e9


def weight_sets(expert_bytes: float, max_reps: int, l2: int) -> int:
    """Weight sets to rotate through, call by call: at least two, and enough that a step of
    one replica reads four times the L2 cache over the sets (``measure-gpu``'s rule), so
    small experts are read from DRAM too; within ``POOL_BYTES``."""
    want = max(2, math.ceil(4 * l2 / max(expert_bytes, 1.0)))
    room = max(2, int(POOL_BYTES // (2 * max(max_reps, 1) * max(expert_bytes, 1.0))))
    return min(want, room)


def one_server(cls_name: str) -> Cluster:
    """A cluster of one server of a catalogue class, derived as a topology file's
    ``gpu: CLASS`` is: where the rule charges a step on that GPU."""
    from topologies import TopologyError, parse_topology
    try:
        mem = gpu_class(cls_name).mem_gb
        return parse_topology({"name": cls_name, "servers": [
            {"name": cls_name, "gpu": cls_name, "cpu_mem_gb": max(64.0, 2 * mem)}]}).to_cluster()
    except TopologyError as err:
        raise HardwareError(str(err)) from None


def sample(steps, n: int, seed: int):
    """A seeded uniform sample of ``n`` steps (all if fewer), in trace order."""
    if n >= len(steps):
        return steps
    pick = np.sort(np.random.default_rng(seed).choice(len(steps), size=n, replace=False))
    return steps.iloc[pick]


@dataclass
class Replay:
    """One step's measured and modeled milliseconds."""

    step: int  # row of the trace
    server: int
    replicas: int
    expert_tokens: int
    dense_tokens: int
    requests: int
    loads: int
    world_ms: float  # what the run charged on its server's class
    method: str
    measured_ms: float
    spread_ms: float
    model_ms: float  # the rule with this method's launches, on the measured class
    note: str = ""
    #: the step itself, so a record can be charged again by a later model (``composition``)
    layer: int = 0
    rep_tokens: str = ""
    rep_gpu: str = ""
    dense_request: str = ""
    dense_position: str = ""

    @property
    def ratio(self) -> float:
        return self.model_ms / self.measured_ms if self.measured_ms > 0 else math.nan


class StepKernels:
    """Weights on the device and each traced step turned into a callable ``fn(i)``."""

    def __init__(self, model, dev: torch.device, gen: torch.Generator, l2: int, max_reps: int,
                 dtype: torch.dtype = torch.float16, attention: str = "masked") -> None:
        if model.cross_attn_per_layer or model.dense_ffn_per_layer or model.self_attn_per_layer != 1:
            raise HardwareError(f"replay-steps: {model.name} has cross-attention or dense FFN "
                                "blocks; only self-attention MoE models (Mixtral, Qwen) replay")
        self.m, self.dev, self.gen, self.dtype = model, dev, gen, dtype
        self.varlen = _varlen() if attention == "varlen" else None
        if attention not in ATTENTION:
            raise HardwareError(f"--attention: unknown {attention!r}; one of {', '.join(ATTENTION)}")
        if attention == "varlen" and (self.varlen is None or dev.type != "cuda"):
            raise HardwareError("--attention varlen needs CUDA and torch.nn.attention.varlen "
                                "(PyTorch >= 2.10); --attention masked runs anywhere")
        shape = model.shape()
        self.ffn = shape.expert_ffn
        self.max_reps = max(1, max_reps)
        self.sets = weight_sets(self.ffn.weight_bytes("fp16"), self.max_reps, l2)
        self.pool = [_ffn_weights(self.ffn, dtype, dev, gen) for _ in range(self.sets * self.max_reps)]
        self.stacks = None
        if dev.type == "cuda":
            self.stacks = []
            for k in range(self.sets):
                ws = self.pool[k * self.max_reps:(k + 1) * self.max_reps]
                self.stacks.append((torch.stack([w[0] for w in ws]).to(torch.bfloat16),
                                    torch.stack([w[1] for w in ws]).to(torch.bfloat16)))
        self.layers = _attention_layers(model, dev, dtype, gen, l2)
        self.shared = None
        if model.shared_expert_d_ff:
            from hetroute.hardware import FfnShape
            sh = FfnShape(model.d_model, model.shared_expert_d_ff, True)
            self.shared = [(_ffn_weights(sh, dtype, dev, gen),
                            _randn(gen, (1, model.d_model), dev, dtype, 1 / math.sqrt(model.d_model)))
                           for _ in range(len(self.layers))]
        nbytes = int(self.ffn.weight_bytes("fp16"))
        host = torch.empty(nbytes // 2, dtype=dtype)
        self.host = host.pin_memory() if dev.type == "cuda" else host
        self.devbuf = torch.empty_like(self.host, device=dev)

    # -- the parts of a step ---------------------------------------------------------
    def _dense(self, requests, positions) -> Callable[[int], torch.Tensor]:
        return (self._dense_varlen if self.varlen is not None else self._dense_masked)(
            requests, positions)

    def _dense_varlen(self, requests, positions) -> Callable[[int], torch.Tensor]:
        """The dense part with one variable-length flash-attention call over the step's
        requests (packed, no padding), as serving engines run it. Causal masking aligns
        each request's queries to the end of its keys (flash attention's rule): exact
        for a prompt's consecutive positions, the same work where positions skip."""
        m, dev = self.m, self.dev
        hq, hkv, hd = m.n_heads, m.n_kv_heads, m.head_dim
        order = _by_request(requests, positions)
        cq, ck, start = [0], [0], []
        for ps in order.values():
            start.append((cq[-1], ck[-1]))
            cq.append(cq[-1] + len(ps))
            ck.append(ck[-1] + max(ps) + 1)
        # a request's queries packed in position order, so the causal rule sees them in order
        rank = [{p: j for j, p in enumerate(sorted(ps))} for ps in order.values()]
        rows = [(start[r][0] + rank[r][p], start[r][1] + p)
                for r, _, p in _token_slots(requests, positions, order)]
        T, Tk = cq[-1], ck[-1]
        max_q = max(len(v) for v in order.values())
        max_k = max(max(v) + 1 for v in order.values())
        cu_q = torch.tensor(cq, device=dev, dtype=torch.int32)
        cu_k = torch.tensor(ck, device=dev, dtype=torch.int32)
        attn, gqa = self.varlen
        rep = hq // hkv

        def attend(qbuf: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
            kk, vv = kc.view(Tk, hkv, hd), vc.view(Tk, hkv, hd)
            if not gqa and rep > 1:
                kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
            return attn(qbuf.view(T, hq, hd), kk, vv, cu_q, cu_k, max_q, max_k).reshape(T, hq * hd)
        return self._dense_layer(rows, T, Tk, attend)

    def _dense_masked(self, requests, positions) -> Callable[[int], torch.Tensor]:
        """The dense part with the step's requests padded to its longest and a causal mask,
        through ``scaled_dot_product_attention`` (runs on a CPU too)."""
        m, dev = self.m, self.dev
        hq, hkv, hd = m.n_heads, m.n_kv_heads, m.head_dim
        order = _by_request(requests, positions)
        R = len(order)
        qmax = max(len(v) for v in order.values())
        kmax = max(max(v) for v in order.values()) + 1
        slots = _token_slots(requests, positions, order)
        allowed = torch.zeros(R, 1, qmax, kmax, dtype=torch.bool)
        allowed[:, :, :, 0] = True  # padded query rows attend to something (no NaN)
        for r, i, p in slots:
            allowed[r, 0, i, :p + 1] = True
        mask = allowed.to(dev)

        def attend(qbuf: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
            a = F.scaled_dot_product_attention(
                qbuf.view(R, qmax, hq, hd).transpose(1, 2), kc.view(R, kmax, hkv, hd).transpose(1, 2),
                vc.view(R, kmax, hkv, hd).transpose(1, 2), attn_mask=mask, enable_gqa=True)
            return a.transpose(1, 2).reshape(R * qmax, hq * hd)
        return self._dense_layer([(r * qmax + i, r * kmax + p) for r, i, p in slots],
                                 R * qmax, R * kmax, attend)

    def _dense_layer(self, rows: list[tuple[int, int]], q_rows: int, kv_rows: int,
                     attend: Callable[..., torch.Tensor]) -> Callable[[int], torch.Tensor]:
        """One layer's dense part around an attention: ``rows`` gives each token (in the
        trace's order) its query row and its key/value row in buffers of ``q_rows`` and
        ``kv_rows``; ``attend(q, k, v)`` returns the context per query row."""
        m, dev, dtype = self.m, self.dev, self.dtype
        d = m.d_model
        q_out, kv_out = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        q_index = torch.tensor([a for a, _ in rows], device=dev)
        kv_index = torch.tensor([b for _, b in rows], device=dev)
        x = _randn(self.gen, (len(rows), d), dev, dtype)
        kc = _randn(self.gen, (kv_rows, kv_out), dev, dtype)
        vc = _randn(self.gen, (kv_rows, kv_out), dev, dtype)
        qbuf = torch.zeros(q_rows, q_out, device=dev, dtype=dtype)
        layers, shared, n = self.layers, self.shared, len(self.layers)

        def dense(i: int) -> torch.Tensor:
            w = layers[i % n]
            h = F.rms_norm(x, (d,), w["ln1"])
            q, k, v = F.linear(h, w["qkv"]).split((q_out, kv_out, kv_out), dim=-1)
            kc.index_copy_(0, kv_index, k)
            vc.index_copy_(0, kv_index, v)
            qbuf.index_copy_(0, q_index, q)
            a = attend(qbuf, kc, vc).index_select(0, q_index)
            x2 = x + F.linear(a, w["o"])
            h2 = F.rms_norm(x2, (d,), w["ln2"])
            F.linear(h2, w["router"]).topk(m.top_k, dim=-1)
            if shared is not None:
                (wi, wo), gate = shared[i % n]
                x2 = x2 + run_ffn(h2, wi, wo, True) * torch.sigmoid(F.linear(h2, gate))
            return x2
        return dense

    def _experts(self, tokens: list[int], method: str) -> Callable[[int], object]:
        dev, d, R = self.dev, self.m.d_model, len(tokens)
        if method == "loop":
            xs = [_randn(self.gen, (c, d), dev, self.dtype) for c in tokens]
            pool, gated, mr, sets = self.pool, self.ffn.gated, self.max_reps, self.sets

            def loop(i: int) -> None:
                base = (i % sets) * mr
                for r, x in enumerate(xs):
                    run_ffn(x, *pool[base + r], gated)
            return loop
        if self.stacks is None:
            raise HardwareError("grouped experts need CUDA (torch._grouped_mm)")
        xs = _randn(self.gen, (sum(tokens), d), dev, torch.bfloat16)
        offs = torch.tensor(np.cumsum(tokens), device=dev, dtype=torch.int32)
        stacks, gated, sets = self.stacks, self.ffn.gated, self.sets

        def grouped(i: int) -> torch.Tensor:
            w_in, w_out = stacks[i % sets]
            h = torch._grouped_mm(xs, w_in[:R].transpose(-2, -1), offs=offs)
            if gated:
                g, u = h.chunk(2, dim=-1)
                h = F.silu(g) * u
            else:
                h = F.relu(h)
            return torch._grouped_mm(h, w_out[:R].transpose(-2, -1), offs=offs)
        return grouped

    def step(self, row, method: str) -> Callable[[int], None]:
        """``fn(i)``: the traced step ``row`` on the device (loads, dense part, experts)."""
        tokens = [int(c) for c in row.rep_tokens]
        if len(tokens) > self.max_reps:
            raise HardwareError(f"a step has {len(tokens)} replicas; weights were made for {self.max_reps}")
        loads = sum(1 for g in row.rep_gpu if not g)
        dense = self._dense(row.dense_request, row.dense_position) if len(row.dense_position) else None
        experts = self._experts(tokens, method) if tokens else None
        host, devbuf = self.host, self.devbuf

        def fn(i: int) -> None:
            for _ in range(loads):
                devbuf.copy_(host, non_blocking=True)
            if dense is not None:
                dense(i)
            if experts is not None:
                experts(i)
        return fn


def _by_request(requests, positions) -> dict[int, list[int]]:
    """A step's dense tokens as request -> positions, requests in order of first token."""
    order: dict[int, list[int]] = {}
    for q, p in zip(requests, positions):
        order.setdefault(int(q), []).append(int(p))
    return order


def _token_slots(requests, positions, order: dict[int, list[int]]) -> list[tuple[int, int, int]]:
    """(request index, index within its request, position) of each token, in trace order."""
    index = {q: r for r, q in enumerate(order)}
    seen: dict[int, int] = {}
    out = []
    for q, p in zip(requests, positions):
        r = index[int(q)]
        i = seen.get(r, 0)
        seen[r] = i + 1
        out.append((r, i, int(p)))
    return out


def _varlen():
    """(causal varlen attention(q, k, v, cu_q, cu_k, max_q, max_k), takes GQA heads) from
    ``torch.nn.attention.varlen`` across its signatures, or None where it is missing."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params
    if gqa:
        kw["enable_gqa"] = True

    def attn(q, k, v, cu_q, cu_k, max_q, max_k):
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    return attn, gqa


def replay(steps, model, cls_name: str, dev: torch.device, reps: int = 7, seed: int = 0,
           l2: int = 64 << 20, methods: tuple[str, ...] = METHODS,
           attention: str = "masked", calls: int = 8) -> Iterator[Replay]:
    """Each traced step (rows of ``read_steps``) measured on ``dev`` by each method, beside
    the rule's charge on class ``cls_name`` with that method's launches (all FP16)."""
    service = HardwareService(one_server(cls_name), model.shape())
    gen = torch.Generator(device=dev).manual_seed(seed)
    max_reps = max((len(t) for t in steps.rep_tokens), default=1)
    # FP16 on a GPU; float32 on a CPU (its half matmuls are not what it would run)
    kernels = StepKernels(model, dev, gen, l2, max_reps,
                          dtype=torch.float16 if dev.type == "cuda" else torch.float32,
                          attention=attention)
    graphs = dev.type == "cuda"
    calls = max(calls, kernels.sets)  # every weight set once per timed pass
    for idx, row in zip(steps.index, steps.itertuples(index=False)):
        fp16 = [int(Precision.FP16)] * len(row.rep_tokens)
        base = dict(step=int(idx), server=int(row.server), replicas=len(row.rep_tokens),
                    expert_tokens=int(sum(row.rep_tokens)), dense_tokens=len(row.dense_position),
                    requests=len(set(row.dense_request)),
                    loads=sum(1 for g in row.rep_gpu if not g), world_ms=float(row.model_s) * 1e3,
                    **composition(row))
        for method in methods:
            model_s = charge(service, 0, int(row.layer), fp16, row.rep_tokens, row.rep_gpu,
                             row.dense_request, row.dense_position, moe_kernels=RULE_OF[method])
            med = spread = math.nan
            note = ""
            try:
                fn = kernels.step(row, method)
                if graphs:
                    try:
                        med, spread = _summary(time_graph(fn, calls, reps))
                        note = "CUDA graph"
                    except Exception as err:  # not capturable here: time it eagerly, and say so
                        torch.cuda.synchronize()
                        note = f"eager (graph capture failed: {type(err).__name__}); "
                if not note.startswith("CUDA"):
                    med, spread = _summary(time_calls(fn, calls, reps, dev))
                    note += "eager"
            except Exception as err:  # a kernel this PyTorch lacks: say so in the row
                med = spread = math.nan
                note += f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            yield Replay(**base, method=method, measured_ms=med, spread_ms=spread,
                         model_ms=model_s * 1e3, note=note)
        if graphs:
            torch.cuda.empty_cache()


def composition(row) -> dict[str, object]:
    """A traced step's make-up as plain fields (space-separated integers; tiers as 0/1)."""
    def ints(xs) -> str:
        return " ".join(str(int(x)) for x in xs)
    return dict(layer=int(row.layer), rep_tokens=ints(row.rep_tokens), rep_gpu=ints(row.rep_gpu),
                dense_request=ints(row.dense_request), dense_position=ints(row.dense_position))


def parse_composition(rec) -> dict[str, list[int]]:
    """``composition``'s fields back to lists (a row of a replay's ``steps.csv``)."""
    def ints(s) -> list[int]:
        return [int(x) for x in str(s).split()] if isinstance(s, str) else []
    return {k: ints(getattr(rec, k)) for k in ("rep_tokens", "rep_gpu", "dense_request",
                                                 "dense_position")}


def summarise(rows: list[Replay]) -> dict[str, dict]:
    """Per method: steps, median and 10-90% of model / measured, and the ratio of the sums
    (the stream time the rule charges for the sample against what it took)."""
    out = {}
    for method in sorted({r.method for r in rows}):
        ok = [r for r in rows if r.method == method and r.measured_ms > 0]
        if not ok:
            out[method] = {"steps": 0}
            continue
        ratios = np.array([r.ratio for r in ok])
        out[method] = {"steps": len(ok),
                       "ratio_p10": round(float(np.percentile(ratios, 10)), 3),
                       "ratio_median": round(float(np.median(ratios)), 3),
                       "ratio_p90": round(float(np.percentile(ratios, 90)), 3),
                       "ratio_of_sums": round(sum(r.model_ms for r in ok) / sum(r.measured_ms for r in ok), 3),
                       "measured_ms_sum": round(sum(r.measured_ms for r in ok), 3),
                       "model_ms_sum": round(sum(r.model_ms for r in ok), 3)}
    return out


def trace_of(run_dir: Path):
    """(spec, steps) of a run folder written with ``--trace-steps``; HardwareError if none."""
    from .records import read_steps
    from .spec import load_spec
    run_dir = Path(run_dir)
    f = run_dir / "spec.resolved.yaml"
    if not f.exists():
        raise HardwareError(f"replay-steps: {run_dir} has no spec.resolved.yaml (not a run folder)")
    steps = read_steps(run_dir)
    if steps.empty:
        raise HardwareError(f"replay-steps: {run_dir} has no steps/ table; run it with "
                            "`python -m testbed run SPEC --trace-steps`")
    spec = load_spec(str(f))
    if spec.physics != "hardware":
        raise HardwareError("replay-steps: the trace is of physics: paper, whose steps are not "
                            "what an engine runs; trace a physics: hardware run")
    return spec, steps
