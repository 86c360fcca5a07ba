"""Measure a CUDA GPU's kernels beside the hardware model's predictions.

``python -m testbed hardware measure-gpu --out DIR``. The hardware model
(``hetroute.hardware``) predicts kernel times from a datasheet and global
achieved fractions; this module runs the same work on the GPU at hand and
writes every measurement next to the model's prediction for that GPU's
catalogue class, so the model is checked on real hardware, never fitted to it.
Parts (each row of ``kernels.csv`` names its part):

- ``ceiling``: a device-to-device copy (bytes read + written), a large FP16
  GEMM, and pinned host-to-device copies of one expert: the achieved fractions
  the model assumes (75% of bandwidth, 70% of the tensor peak, 80% of PCIe);
- ``ffn``: expert FFNs as serving engines run them (vLLM's layout: one fused
  gate/up GEMM, SiLU-and-multiply, the down GEMM; Switch: GEMM, ReLU, GEMM) at
  1-4096 tokens in FP16, weights rotated through a pool of four times the L2
  cache so every call reads them from DRAM, as a server cycling through its
  experts does. Timed two ways: ``eager`` (PyTorch launches included: what an
  emulator worker pays) against the model with its launch term, and ``graph``
  (CUDA-graph replays: kernels and their gaps) against the model without it;
- ``step``: E different experts of b tokens each, run back to back: the step
  rule charges the sum of the replicas' kernel times, each reading its weights
  once;
- ``dense``: the dense part of a Mixtral decode layer for b sequences with P
  cached positions each (RMSNorm, QKV projection, appending to the KV cache,
  attention over the cache, output projection, residual, RMSNorm, router; no
  rotary embedding) against ``hetroute.service.dense_seconds``;
- ``prefill``: a prompt step of R requests of L tokens through one Mixtral layer:
  its dense part (causal attention) and the whole layer with its routed experts;
- ``int4``: weight-only INT4 FFNs through PyTorch's tinygemm kernel
  (``torch._weight_int4pack_mm``, BF16 activations, groups of 128) where this
  PyTorch has it; a row with the error otherwise.

Timing follows the usual rules: CUDA events, warm-up first, the median of
several repetitions, random (never zero) data.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from hetroute.hardware import Device, FfnShape, HardwareError, ffn_seconds, gpu_class
from hetroute.service import PCIE_EFFICIENCY, dense_seconds
from workloads.models import get_model

#: FFN shapes measured: the experts of the catalogue's models, Qwen's shared expert
#: and Llama-2-7B's MLP (the shape of the published profiles the fractions came from).
SHAPES: dict[str, tuple[int, int, bool]] = {
    "mixtral-expert": (4096, 14336, True),
    "llama2-7b-mlp": (4096, 11008, True),
    "qwen-shared-expert": (2048, 5632, True),
    "qwen-expert": (2048, 1408, True),
    "switch-expert": (768, 3072, False),
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
QUICK_TOKENS = (1, 8, 64, 256, 1024)
STEP_EXPERTS = (1, 2, 4, 8)
STEP_TOKENS = (1, 16, 128)
QWEN_STEP_EXPERTS = (1, 4, 16, 60)
PREFILL_REQUESTS = (1, 4, 16)
PREFILL_LENGTHS = (36, 128)
DENSE_TOKENS = (1, 8, 32, 128)
DENSE_POSITIONS = (128, 1024, 4096)
INT4_TOKENS = (1, 8, 64, 256)
INT4_GROUP = 128

#: Substrings of ``torch.cuda.get_device_name`` -> catalogue class, first match wins.
NAME_TO_CLASS = (
    ("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"),
    ("A100-PCIE-40GB", "a100-40"), ("A100", "a100-80"), ("RTX A6000", "rtxa6000"),
    ("A40", "a40"), ("A30", "a30"), ("A10", "a10"), ("L4", "l4"), ("RTX 4090", "rtx4090"),
    ("RTX 3090", "rtx3090"), ("T4", "t4"), ("V100", "v100"), ("Orin", "orin64"), ("A2", "a2"),
)


def class_for(device_name: str) -> str:
    """The catalogue class of a CUDA device name; HardwareError when none matches. A model
    name matches as a whole word, so an L40S is not taken for an L4."""
    for sub, cls in NAME_TO_CLASS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(sub)}(?![A-Za-z0-9])", device_name, re.I):
            return cls
    raise HardwareError(f"no catalogue class matches GPU {device_name!r}; pass --gpu CLASS")


@dataclass
class Row:
    part: str
    shape: str
    method: str
    precision: str
    tokens: int
    experts: int
    positions: int
    measured_ms: float
    spread_ms: float  # max - min over repetitions
    model_ms: float  # the model's time, its launch term included
    model_nolaunch_ms: float  # the same without the launch term (kernel time alone)
    note: str = ""

    @property
    def ratio(self) -> float:
        """model / measured: above 1 the model is pessimistic."""
        return self.model_ms / self.measured_ms if self.measured_ms > 0 else math.nan

    @property
    def ratio_nolaunch(self) -> float:
        return self.model_nolaunch_ms / self.measured_ms if self.measured_ms > 0 else math.nan

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["ratio"], d["ratio_nolaunch"] = self.ratio, self.ratio_nolaunch
        return d


# -- timing -------------------------------------------------------------------------

def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_calls(fn: Callable[[int], object], calls: int, reps: int, dev: torch.device,
               warmup: int = 2) -> list[float]:
    """Seconds per call of ``fn(i)`` for i in 0..calls-1, once per repetition."""
    for i in range(warmup):
        fn(i % calls)
    _sync(dev)
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(calls):
                fn(i)
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3 / calls)
        else:
            t = time.perf_counter()
            for i in range(calls):
                fn(i)
            out.append((time.perf_counter() - t) / calls)
    return out


def time_graph(fn: Callable[[int], object], calls: int, reps: int) -> list[float]:
    """Seconds per call when the ``calls`` calls are captured once and replayed as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(calls, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / calls)
    del g
    return out


def _summary(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples) * 1e3, (max(samples) - min(samples)) * 1e3


def _pool_size(nbytes: float, l2_bytes: int, cap_bytes: float = 6e9) -> int:
    """Weight sets to rotate through so each call reads from DRAM (at least 4x L2)."""
    want = max(2, math.ceil(4 * l2_bytes / max(nbytes, 1.0)))
    return max(2, min(want, int(cap_bytes // max(nbytes, 1.0))))


# -- the kernels ----------------------------------------------------------------------

def _randn(gen: torch.Generator, size: tuple, dev: torch.device, dtype: torch.dtype,
           scale: float = 1.0) -> torch.Tensor:
    """Seeded normal values made on the device itself (host generation of GBs is slow)."""
    x = torch.randn(size, generator=gen, device=dev, dtype=torch.float32 if dev.type == "cpu" else dtype)
    return (x * scale if scale != 1.0 else x).to(dtype)


def _ffn_weights(ffn: FfnShape, dtype: torch.dtype, dev: torch.device, gen: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_in [m*d_ff, d], w_out [d, d_ff]): m = 2 for a fused gate/up, 1 otherwise."""
    m = 2 if ffn.gated else 1
    s = 1 / math.sqrt(ffn.d_model)
    w_in = _randn(gen, (m * ffn.d_ff, ffn.d_model), dev, dtype, s)
    w_out = _randn(gen, (ffn.d_model, ffn.d_ff), dev, dtype, s)
    return w_in, w_out


def run_ffn(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, gated: bool) -> torch.Tensor:
    h = F.linear(x, w_in)
    if gated:
        g, u = h.chunk(2, dim=-1)
        h = F.silu(g) * u
    else:
        h = F.relu(h)
    return F.linear(h, w_out)


def measure_ffn(dev: torch.device, model: Device, shapes: dict[str, tuple[int, int, bool]],
                tokens: Iterable[int], reps: int, gen: torch.Generator, l2: int,
                dtype: torch.dtype = torch.float16, graphs: bool = True,
                progress: Callable[[str], None] = lambda s: None) -> list[Row]:
    rows = []
    for name, (d, dff, gated) in shapes.items():
        ffn = FfnShape(d, dff, gated)
        n = _pool_size(ffn.weight_bytes("fp16"), l2)
        pool = [_ffn_weights(ffn, dtype, dev, gen) for _ in range(n)]
        for b in tokens:
            x = _randn(gen, (b, d), dev, dtype)
            calls = max(n, 16)
            fn = lambda i: run_ffn(x, *pool[i % n], gated)  # noqa: E731
            model_s = ffn_seconds(model, ffn, b, "fp16")
            bare = model_s - 3 * model.launch_s
            med, spread = _summary(time_calls(fn, calls, reps, dev))
            rows.append(Row("ffn", name, "eager", "fp16", b, 1, 0, med, spread, model_s * 1e3, bare * 1e3))
            if graphs and dev.type == "cuda":
                med, spread = _summary(time_graph(fn, calls, reps))
                rows.append(Row("ffn", name, "graph", "fp16", b, 1, 0, med, spread, model_s * 1e3,
                                bare * 1e3))
            progress(f"ffn {name} tokens={b}")
        del pool
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def measure_step(dev: torch.device, model: Device, reps: int, gen: torch.Generator, l2: int,
                 dtype: torch.dtype = torch.float16, shape: str = "mixtral-expert",
                 experts: Iterable[int] = STEP_EXPERTS, tokens: Iterable[int] = STEP_TOKENS
                 ) -> list[Row]:
    """E distinct experts of b tokens back to back (the step rule's sum), eagerly, as a
    CUDA graph, and (on CUDA) as one grouped GEMM per matrix."""
    d, dff, gated = SHAPES[shape]
    ffn = FfnShape(d, dff, gated)
    grouped = _grouped_row(dev, ffn, shape, reps) if dev.type == "cuda" else None
    experts = tuple(experts)
    emax = max(experts)
    sets = max(2, math.ceil(_pool_size(ffn.weight_bytes("fp16"), l2) / emax))
    pool = [_ffn_weights(ffn, dtype, dev, gen) for _ in range(emax * sets)]
    rows = []
    for b in tokens:
        x = _randn(gen, (b, d), dev, dtype)
        for e in experts:
            def step(i: int, e: int = e) -> None:
                base = (i % sets) * emax
                for j in range(e):
                    run_ffn(x, *pool[base + j], gated)
            model_s = e * ffn_seconds(model, ffn, b, "fp16")
            bare = model_s - e * 3 * model.launch_s
            med, spread = _summary(time_calls(step, max(sets, 8), reps, dev))
            rows.append(Row("step", shape, "eager", "fp16", b, e, 0, med, spread, model_s * 1e3, bare * 1e3))
            if dev.type == "cuda":
                med, spread = _summary(time_graph(step, max(sets, 8), reps))
                rows.append(Row("step", shape, "graph", "fp16", b, e, 0, med, spread, model_s * 1e3,
                                bare * 1e3))
            if grouped is not None:
                rows.append(grouped(pool, x, b, e, sets, emax, model_s, bare))
    return rows


def _grouped_row(dev: torch.device, ffn: FfnShape, shape: str, reps: int
                 ) -> Callable[..., Row]:
    """One fused launch per matrix for all E experts of a step (``torch._grouped_mm``, BF16),
    as fused-MoE kernels do: the same weights read, E x fewer launches."""
    def row(pool, x, b, e, sets, emax, model_s, bare) -> Row:
        try:
            stacks = []
            for k in range(sets):
                ws = pool[k * emax:k * emax + e]
                stacks.append((torch.stack([w[0] for w in ws]).to(torch.bfloat16),
                               torch.stack([w[1] for w in ws]).to(torch.bfloat16)))
            xs = x.to(torch.bfloat16).repeat(e, 1)
            offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * b

            def step(i: int) -> torch.Tensor:
                w_in, w_out = stacks[i % sets]
                h = torch._grouped_mm(xs, w_in.transpose(-2, -1), offs=offs)
                if ffn.gated:
                    g, u = h.chunk(2, dim=-1)
                    h = F.silu(g) * u
                else:
                    h = F.relu(h)
                return torch._grouped_mm(h, w_out.transpose(-2, -1), offs=offs)

            med, spread = _summary(time_graph(step, max(sets, 8), reps))
            out = Row("step", shape, "grouped", "bf16", b, e, 0, med, spread, model_s * 1e3,
                      bare * 1e3, "torch._grouped_mm, CUDA graph")
            del stacks
            return out
        except Exception as err:  # an optional kernel: record why it is missing
            return Row("step", shape, "grouped", "bf16", b, e, 0, math.nan, math.nan, model_s * 1e3,
                       bare * 1e3, f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
    return row


def measure_dense(dev: torch.device, model: Device, reps: int, gen: torch.Generator, l2: int,
                  model_name: str = "mixtral", tokens: Iterable[int] = DENSE_TOKENS,
                  positions: Iterable[int] = DENSE_POSITIONS,
                  dtype: torch.dtype = torch.float16) -> list[Row]:
    """One decode step's dense part for b sequences with P cached positions each."""
    spec = get_model(model_name)
    shape = spec.shape()
    d, hq, hkv, hd = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim
    q_out, kv_out = hq * hd, hkv * hd
    layers = _attention_layers(spec, dev, dtype, gen, l2)
    n = len(layers)
    rows = []
    for p in positions:
        for b in tokens:
            caches = [(_randn(gen, (b, hkv, p + 1, hd), dev, dtype),
                       _randn(gen, (b, hkv, p + 1, hd), dev, dtype)) for _ in range(n)]
            x = _randn(gen, (b, d), dev, dtype)

            def step(i: int, b: int = b, p: int = p) -> torch.Tensor:
                w, (kc, vc) = layers[i % n], caches[i % n]
                h = F.rms_norm(x, (d,), w["ln1"])
                q, k, v = F.linear(h, w["qkv"]).split((q_out, kv_out, kv_out), dim=-1)
                kc[:, :, p].copy_(k.view(b, hkv, hd))
                vc[:, :, p].copy_(v.view(b, hkv, hd))
                a = F.scaled_dot_product_attention(q.view(b, hq, 1, hd), kc, vc, enable_gqa=True)
                x2 = x + F.linear(a.reshape(b, q_out), w["o"])
                logits = F.linear(F.rms_norm(x2, (d,), w["ln2"]), w["router"])
                return logits.topk(spec.top_k, dim=-1).indices

            model_s = dense_seconds(model, shape, b, b * (p + 1), b * p)
            bare = model_s - shape.dense_kernels * model.launch_s
            med, spread = _summary(time_calls(step, max(n, 16), reps, dev))
            rows.append(Row("dense", spec.name, "eager", "fp16", b, 0, p, med, spread, model_s * 1e3,
                            bare * 1e3))
            if dev.type == "cuda":
                med, spread = _summary(time_graph(step, max(n, 16), reps))
                rows.append(Row("dense", spec.name, "graph", "fp16", b, 0, p, med, spread,
                                model_s * 1e3, bare * 1e3))
            del caches
    return rows


def _attention_layers(spec, dev: torch.device, dtype: torch.dtype, gen: torch.Generator, l2: int
                      ) -> list[dict]:
    """Weight sets of a layer's dense part (norms, QKV, output projection, router), enough
    of them to rotate through so each step reads its weights from DRAM."""
    d, E = spec.d_model, spec.experts_per_layer
    q_out, kv_out = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    s = 1 / math.sqrt(d)
    n = _pool_size(2.0 * (d * (q_out + 2 * kv_out) + q_out * d + E * d), l2)
    return [{"ln1": torch.ones(d, device=dev, dtype=dtype), "ln2": torch.ones(d, device=dev, dtype=dtype),
             "qkv": _randn(gen, (q_out + 2 * kv_out, d), dev, dtype, s),
             "o": _randn(gen, (d, q_out), dev, dtype, s),
             "router": _randn(gen, (E, d), dev, dtype, s)} for _ in range(n)]


def measure_prefill(dev: torch.device, model: Device, reps: int, gen: torch.Generator, l2: int,
                    model_name: str = "mixtral", requests: Iterable[int] = PREFILL_REQUESTS,
                    lengths: Iterable[int] = PREFILL_LENGTHS, dtype: torch.dtype = torch.float16
                    ) -> list[Row]:
    """A prompt step of R requests of L tokens through one MoE layer, the paper's workload
    (prompt only): the dense part (causal attention within each prompt), then the whole
    layer with its routed experts (top-k, tokens spread evenly, gathered and scattered back).
    Against ``dense_seconds`` and the step rule: dense + each active expert's kernel time,
    with per-expert launches (``model_ms``) and fused ones (in ``note``)."""
    spec = get_model(model_name)
    shape = spec.shape()
    ffn = shape.expert_ffn
    d, hq, hkv, hd, E, k = (spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim,
                            spec.experts_per_layer, spec.top_k)
    q_out, kv_out = hq * hd, hkv * hd
    layers = _attention_layers(spec, dev, dtype, gen, l2)
    n = len(layers)
    sets = max(2, math.ceil(_pool_size(ffn.weight_bytes("fp16"), l2) / E))
    experts = [_ffn_weights(ffn, dtype, dev, gen) for _ in range(E * sets)]
    timer = (lambda fn, calls: time_graph(fn, calls, reps)) if dev.type == "cuda" else (
        lambda fn, calls: time_calls(fn, calls, reps, dev))
    method = "graph" if dev.type == "cuda" else "eager"
    rows = []
    for L in lengths:
        for R in requests:
            T = R * L
            x = _randn(gen, (T, d), dev, dtype)
            # token t goes to experts t, t+1, .., t+k-1 (mod E): every expert gets T*k/E tokens
            idx = [torch.tensor([t for t in range(T) if (e - t) % E < k], device=dev) for e in range(E)]

            def dense(i: int, R: int = R, L: int = L, T: int = T) -> tuple[torch.Tensor, torch.Tensor]:
                w = layers[i % n]
                h = F.rms_norm(x, (d,), w["ln1"])
                q, kk, v = F.linear(h, w["qkv"]).split((q_out, kv_out, kv_out), dim=-1)
                q = q.view(R, L, hq, hd).transpose(1, 2)
                kk = kk.view(R, L, hkv, hd).transpose(1, 2)
                v = v.view(R, L, hkv, hd).transpose(1, 2)
                a = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)
                x2 = x + F.linear(a.transpose(1, 2).reshape(T, q_out), w["o"])
                h2 = F.rms_norm(x2, (d,), w["ln2"])
                F.linear(h2, w["router"]).topk(k, dim=-1)
                return x2, h2

            def layer(i: int, idx: list = idx) -> torch.Tensor:
                x2, h2 = dense(i)
                base = (i % sets) * E
                out = torch.zeros_like(x2)
                for e in range(E):
                    out.index_add_(0, idx[e], run_ffn(h2.index_select(0, idx[e]), *experts[base + e],
                                                      ffn.gated))
                return x2 + out

            dense_s = dense_seconds(model, shape, T, R * L * (L + 1) // 2, T)
            per = dense_s + E * ffn_seconds(model, ffn, T * k // E, "fp16")
            fused = per - (E - 1) * 3 * model.launch_s
            calls = max(n, sets, 8)
            med, spread = _summary(timer(dense, calls))
            rows.append(Row("prefill", f"{spec.name} dense", method, "fp16", T, 0, L, med, spread,
                            dense_s * 1e3, (dense_s - shape.dense_kernels * model.launch_s) * 1e3,
                            f"{R} requests x {L} tokens"))
            med, spread = _summary(timer(layer, calls))
            rows.append(Row("prefill", f"{spec.name} layer", method, "fp16", T, E, L, med, spread,
                            per * 1e3, (per - (shape.dense_kernels + 3 * E) * model.launch_s) * 1e3,
                            f"{R} requests x {L} tokens; fused rule {fused * 1e3:.4f} ms"))
    return rows


def measure_int4(dev: torch.device, model: Device, reps: int, gen: torch.Generator, l2: int,
                 shapes: Iterable[str] = ("mixtral-expert", "qwen-expert"),
                 tokens: Iterable[int] = INT4_TOKENS) -> list[Row]:
    """Weight-only INT4 FFNs through tinygemm; one row with the error where it is missing."""
    rows = []
    for name in shapes:
        d, dff, gated = SHAPES[name]
        ffn = FfnShape(d, dff, gated)
        try:
            def pack(out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
                w = torch.randint(0, 256, (out_f, in_f // 2), generator=gen, dtype=torch.uint8,
                                  device=dev)
                packed = torch._convert_weight_to_int4pack(w, 8)
                sz = _randn(gen, (in_f // INT4_GROUP, out_f, 2), dev, torch.bfloat16, 0.01)
                return packed, sz

            n = _pool_size(ffn.weight_bytes("int4"), l2)
            m = 2 if gated else 1
            pool = [(pack(m * dff, d), pack(d, dff)) for _ in range(n)]

            def run(x: torch.Tensor, i: int) -> torch.Tensor:
                (wi, si), (wo, so) = pool[i % n]
                h = torch._weight_int4pack_mm(x, wi, INT4_GROUP, si)
                if gated:
                    g, u = h.chunk(2, dim=-1)
                    h = F.silu(g) * u
                else:
                    h = F.relu(h)
                return torch._weight_int4pack_mm(h.contiguous(), wo, INT4_GROUP, so)

            for b in tokens:
                x = _randn(gen, (b, d), dev, torch.bfloat16)
                med, spread = _summary(time_calls(lambda i: run(x, i), max(n, 16), reps, dev))
                m = ffn_seconds(model, ffn, b, "int4")
                rows.append(Row("int4", name, "eager", "int4", b, 1, 0, med, spread, m * 1e3,
                                (m - 3 * model.launch_s) * 1e3, "tinygemm W4A16 (bf16), group 128"))
            del pool
        except Exception as err:  # an optional kernel: record why it is missing
            rows.append(Row("int4", name, "eager", "int4", 0, 1, 0, math.nan, math.nan, math.nan,
                            math.nan, f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:160]}"))
    return rows


def measure_ceilings(dev: torch.device, model: Device, pcie_gb_s: float, reps: int,
                     gen: torch.Generator, copy_values: int = 1 << 28, gemm: int = 8192,
                     load_shape: str = "mixtral-expert") -> list[Row]:
    rows = []
    a = _randn(gen, (copy_values // 1024, 1024), dev, torch.float16)
    b = torch.empty_like(a)
    med, spread = _summary(time_calls(lambda i: b.copy_(a), 4, reps, dev))
    nbytes = 2.0 * a.numel() * 2
    rows.append(Row("ceiling", "copy d2d GB/s", "eager", "fp16", 0, 0, 0, med, spread,
                    nbytes / model.mem_bw * 1e3, nbytes / model.mem_bw * 1e3, f"achieved {nbytes / med / 1e6:.0f} GB/s"))
    del a, b
    k = gemm
    x = _randn(gen, (k, k), dev, torch.float16)
    w = _randn(gen, (k, k), dev, torch.float16)
    med, spread = _summary(time_calls(lambda i: x @ w, 4, reps, dev))
    flops = 2.0 * k ** 3
    rows.append(Row("ceiling", f"gemm {k}^3 TFLOP/s", "eager", "fp16", k, 0, 0, med, spread,
                    flops / model.flops * 1e3, flops / model.flops * 1e3, f"achieved {flops / med / 1e9:.0f} TFLOP/s"))
    del x, w
    ffn = FfnShape(*SHAPES[load_shape])
    host = torch.randn(int(ffn.weight_bytes("fp16")) // 2,
                       generator=torch.Generator().manual_seed(int(gen.initial_seed()))).to(torch.float16)
    if dev.type == "cuda":
        host = host.pin_memory()
    devbuf = torch.empty_like(host, device=dev)
    med, spread = _summary(time_calls(lambda i: devbuf.copy_(host, non_blocking=True), 2, reps, dev))
    model_ms = ffn.weight_bytes("fp16") / (pcie_gb_s * 1e9 * PCIE_EFFICIENCY) * 1e3
    rows.append(Row("ceiling", "h2d expert load GB/s", "eager", "fp16", 0, 1, 0, med, spread, model_ms,
                    model_ms, f"achieved {host.numel() * 2 / med / 1e6:.1f} GB/s (pinned)"))
    del host, devbuf
    # the fixed cost of one small kernel: eagerly (PyTorch's dispatch on this host's CPU) and
    # inside a CUDA graph; the model charges LAUNCH_S for each
    a = _randn(gen, (8, 64), dev, torch.float16)
    w = _randn(gen, (64, 64), dev, torch.float16)
    calls = 200
    for method, samples in (("eager", time_calls(lambda i: a @ w, calls, reps, dev)),
                            ("graph", time_graph(lambda i: a @ w, calls, reps) if dev.type == "cuda"
                             else None)):
        if samples is None:
            continue
        med, spread = _summary(samples)
        rows.append(Row("ceiling", "one small kernel", method, "fp16", 8, 0, 0, med, spread,
                        model.launch_s * 1e3, 0.0, "[8,64]x[64,64]"))
    return rows


def environment(dev: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": str(dev)}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   memory_gb=round(p.total_memory / 1e9, 1), l2_bytes=getattr(p, "L2_cache_size", 0),
                   cuda=torch.version.cuda)
    return env


def l2_bytes(dev: torch.device) -> int:
    if dev.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 64 << 20)
    return 64 << 20


def measure(parts: Iterable[str], gpu: str | None = None, quick: bool = False, reps: int = 7,
            seed: int = 0, progress: Callable[[str], None] = lambda s: None) -> tuple[list[Row], dict]:
    """Every requested part on the CUDA device; (rows, environment)."""
    if not torch.cuda.is_available():
        raise HardwareError("measure-gpu: no CUDA device here (torch.cuda.is_available() is False)")
    dev = torch.device("cuda")
    env = environment(dev)
    cls = gpu_class(gpu or class_for(env["name"]))
    env["catalogue_class"] = cls.name
    model = Device.from_class(cls)
    gen = torch.Generator(device=dev).manual_seed(seed)
    l2 = l2_bytes(dev)
    tokens = QUICK_TOKENS if quick else TOKENS
    rows: list[Row] = []
    with torch.inference_mode():
        for part in parts:
            t = time.perf_counter()
            if part == "ceiling":
                rows += measure_ceilings(dev, model, cls.pcie_gb_s, reps, gen)
            elif part == "ffn":
                rows += measure_ffn(dev, model, SHAPES, tokens, reps, gen, l2, progress=progress)
            elif part == "step":
                rows += measure_step(dev, model, reps, gen, l2)
                rows += measure_step(dev, model, reps, gen, l2, shape="qwen-expert",
                                     experts=QWEN_STEP_EXPERTS)
            elif part == "dense":
                rows += measure_dense(dev, model, reps, gen, l2)
            elif part == "prefill":
                rows += measure_prefill(dev, model, reps, gen, l2)
            elif part == "int4":
                rows += measure_int4(dev, model, reps, gen, l2)
            else:
                raise HardwareError(f"--parts: unknown part {part!r}; one of ceiling, ffn, step, dense, prefill, int4")
            progress(f"{part} done in {time.perf_counter() - t:.1f} s")
    return rows, env
