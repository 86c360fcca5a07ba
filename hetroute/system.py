"""The problem instance placement and routing reason about (paper Section III-A).

Everything here is in SI base units so that every cost term of eq. (9) comes out
in seconds without conversions: seconds, bytes, bytes/s, FLOPs and FLOP/s. The
YAML topology format and the model catalogue convert into these types; nothing
in ``hetroute`` reads files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Mapping

from .hardware import Device, FfnShape, nearest_class


class Precision(IntEnum):
    """Quantization level c of a replica; FP16 is c_max (zero quantization loss)."""

    FP16 = 0
    INT8 = 1
    INT4 = 2

    @property
    def label(self) -> str:
        return self.name.lower()


FULL_PRECISION = Precision.FP16


@dataclass(frozen=True)
class Cluster:
    """N heterogeneous edge servers and the directed links between them.

    ``bandwidth[m][n]`` is B_link^{m,n} in bytes/s and ``delay[m][n]`` the one-way
    propagation-plus-queueing latency in seconds (the diagonal is ignored).

    The hardware of each server beyond the paper's four numbers (``gpu_class``,
    peak memory bandwidth ``mem_bw``, CUDA-core ``alu_flops`` and the weight
    formats it has kernels for) is optional: where missing it is taken from
    the catalogue class nearest in F_n and G_n (``hetroute.hardware``) and
    ``derived`` says so per server.
    """

    names: tuple[str, ...]
    flops: tuple[float, ...]  # F_n, FLOP/s
    pcie: tuple[float, ...]  # beta_n, bytes/s (GPU<->CPU)
    gpu_bytes: tuple[float, ...]  # G_n
    cpu_bytes: tuple[float, ...]  # C_n
    bandwidth: tuple[tuple[float, ...], ...]
    delay: tuple[tuple[float, ...], ...]
    gpu_class: tuple[str, ...] | None = None  # catalogue name, or "custom"
    mem_bw: tuple[float, ...] | None = None  # peak GPU memory bandwidth, bytes/s
    alu_flops: tuple[float, ...] | None = None  # peak FP32 CUDA-core FLOP/s (dequantisation)
    precisions: tuple[tuple[str, ...], ...] | None = None  # weight formats with kernels
    derived: tuple[str, ...] = ()  # per server: which hardware fields were derived, and from what

    def __post_init__(self) -> None:
        n = len(self.names)
        if n == 0:
            raise ValueError("a cluster needs at least one server")
        for label, seq in (("flops", self.flops), ("pcie", self.pcie),
                           ("gpu_bytes", self.gpu_bytes), ("cpu_bytes", self.cpu_bytes)):
            if len(seq) != n:
                raise ValueError(f"{label} has {len(seq)} entries for {n} servers")
            if any(not (v > 0 and math.isfinite(v)) for v in seq):
                raise ValueError(f"{label} must be positive and finite")
        for label, mat in (("bandwidth", self.bandwidth), ("delay", self.delay)):
            if len(mat) != n or any(len(row) != n for row in mat):
                raise ValueError(f"{label} must be an {n}x{n} matrix")
        for m in range(n):
            for k in range(n):
                if m != k and not self.bandwidth[m][k] > 0:
                    raise ValueError(f"bandwidth {self.names[m]}->{self.names[k]} must be > 0")
                if m != k and self.delay[m][k] < 0:
                    raise ValueError(f"delay {self.names[m]}->{self.names[k]} must be >= 0")
        self._derive_hardware()

    def _derive_hardware(self) -> None:
        n = len(self.names)
        cls, bw, alu, prec, notes = [], [], [], [], []
        for i in range(n):
            near = nearest_class(self.flops[i] / 1e12, self.gpu_bytes[i] / 1e9)
            missing = []
            c = self.gpu_class[i] if self.gpu_class else None
            b = self.mem_bw[i] if self.mem_bw else None
            a = self.alu_flops[i] if self.alu_flops else None
            p = self.precisions[i] if self.precisions else None
            if b is None:
                b = near.mem_bw_gb_s * 1e9
                missing.append("mem_bw")
            if a is None:
                a = near.alu_tflops * 1e12
                missing.append("alu")
            if p is None:
                p = near.precisions
                missing.append("precisions")
            if c is None:
                c = "custom"
            for label, v in (("mem_bw", b), ("alu_flops", a)):
                if not (v > 0 and math.isfinite(v)):
                    raise ValueError(f"{label} of {self.names[i]} must be positive and finite")
            cls.append(c)
            bw.append(float(b))
            alu.append(float(a))
            prec.append(tuple(p))
            notes.append(f"{', '.join(missing)} from nearest class {near.name}" if missing else "")
        object.__setattr__(self, "gpu_class", tuple(cls))
        object.__setattr__(self, "mem_bw", tuple(bw))
        object.__setattr__(self, "alu_flops", tuple(alu))
        object.__setattr__(self, "precisions", tuple(prec))
        if not self.derived:
            object.__setattr__(self, "derived", tuple(notes))

    @property
    def n(self) -> int:
        return len(self.names)

    def device(self, n: int) -> Device:
        """Server n's achieved rates: datasheet peaks times the global achieved fractions."""
        return Device.from_peaks(f"{self.names[n]} ({self.gpu_class[n]})", self.flops[n] / 1e12,
                                 self.mem_bw[n] / 1e9, self.alu_flops[n] / 1e12, self.precisions[n])


@dataclass(frozen=True)
class MoEShape:
    """The served MoE model as the cost model sees it (Section III-A).

    All experts of a model have the same size, so w_E and v(c) are per model.
    ``hidden_bytes`` is d_in = d_out, one token's hidden state on the wire.
    ``dense_flops``/``dense_bytes`` are the per-layer non-expert part (attention,
    router, shared expert), which runs where the token resides and is held by
    every server.

    What the hardware model needs beyond the paper's numbers: the expert's FFN
    shape (derived from ``expert_flops`` as a gated FFN when not given), the
    KV-cache bytes one token adds per layer, the attention FLOPs per token per
    position attended, and the kernels the dense part launches.
    """

    name: str
    n_layers: int
    experts_per_layer: int
    top_k: int
    d_model: int
    expert_flops: float  # w_E per token, FLOPs
    expert_bytes: Mapping[Precision, int] = field(hash=False)  # v(c)
    hidden_bytes: int
    dense_flops: float = 0.0
    dense_bytes: int = 0
    expert_ffn: FfnShape | None = None
    kv_bytes_per_token: int = 0
    attn_flops_per_position: float = 0.0
    dense_kernels: int = 8

    def __post_init__(self) -> None:
        if self.expert_ffn is None:
            d_ff = max(1, round(self.expert_flops / 2 / (3 * self.d_model)))
            object.__setattr__(self, "expert_ffn", FfnShape(self.d_model, d_ff, gated=True))
        if self.n_layers < 1 or self.experts_per_layer < 1:
            raise ValueError("a model needs at least one layer and one expert")
        if not 1 <= self.top_k <= self.experts_per_layer:
            raise ValueError("top_k must be in [1, experts_per_layer]")
        if FULL_PRECISION not in self.expert_bytes:
            raise ValueError("expert_bytes must include FP16 (c_max)")

    @property
    def n_experts(self) -> int:
        return self.n_layers * self.experts_per_layer

    def expert_id(self, layer: int, j: int) -> int:
        return layer * self.experts_per_layer + j

    def layer_of(self, expert: int) -> int:
        return expert // self.experts_per_layer

    @property
    def precisions(self) -> tuple[Precision, ...]:
        return tuple(sorted(self.expert_bytes))
