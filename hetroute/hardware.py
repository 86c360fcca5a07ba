"""Hardware model: real GPU classes and the time a kernel takes on them.

Pure data and arithmetic, no I/O. Two users, kept apart on purpose:
- the *world* (both backends, ``physics: hardware``) charges every step of a
  server's stream by these rules;
- a router may *believe* them (``cost_model: hardware``) or keep the paper's
  w/F belief (``cost_model: paper``). The formulas are shared; which one a
  run uses for what is the run's choice (see ``hetroute.service``).

Kernel time (issue 12, the roofline of Williams et al., CACM 2009)::

    t = kernels * launch + max(FLOPs / achieved FLOP/s + dequant ops / achieved ALU op/s,
                               bytes / achieved memory bandwidth)

At edge batch sizes an expert FFN is memory-bound: a batch reads all of the
expert's weights once, so its time is nearly flat in the number of tokens
until FLOPs / F exceeds bytes / BW (about 100-300 tokens on these classes).
INT8/INT4 are weight-only formats (W8A16/W4A16, as GPTQ/AWQ/Marlin kernels
run them): weights are read at 1 or 0.5 bytes per value plus scales, and each
weight is dequantised once per kernel on the CUDA cores before FP16 tensor
math. A class that has no such kernels (vLLM's Marlin needs compute
capability 8.0) lacks those precisions.

Achieved fractions are global constants, the same for every GPU (not fitted
per class or per case). They were chosen from public measurements of FP16
GEMMs of gated MLPs of Llama-2-7B on A40, A100 and H100 at one GPU (the
profiles shipped with Vidur, Agrawal et al., MLSys 2024, ``data/profiling/
compute/*/meta-llama/Llama-2-7b-hf/mlp.csv``): at 1-64 tokens the three GEMMs
of the MLP move its 270 MB at 72-79% of the datasheet bandwidth, and at 4096
tokens they run at 68-72% of the dense FP16 tensor peak. Other models of the
same profiles (Llama-2-70B, CodeLlama-34B, InternLM-20B, Qwen-72B) are held
out; ``python -m testbed hardware validate`` compares the model with any such
profile a user has (the profiles are not in this repository).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from typing import Mapping

#: Share of datasheet memory bandwidth a streaming GEMM/GEMV achieves (see module doc).
MEM_EFFICIENCY = 0.75
#: Share of the dense FP16 tensor peak a large GEMM achieves (see module doc).
TENSOR_EFFICIENCY = 0.70
#: Share of the FP32 CUDA-core peak dequantisation arithmetic achieves (our choice).
ALU_EFFICIENCY = 0.5
#: Seconds per kernel launch. CUDA launch latency is a few microseconds
#: (NVIDIA's CUDA C++ Best Practices Guide; ~5 us is the figure vLLM's and
#: SGLang's motivation for CUDA graphs cite); serving engines launch an
#: expert as a fused gate/up GEMM, the activation and the down GEMM.
LAUNCH_S = 5e-6
#: ALU operations per weight to dequantise W8 and W4 formats (convert and
#: scale; W4 also unpacks nibbles). Our choice, documented, not a datasheet fact.
DEQUANT_OPS = {"fp16": 0.0, "int8": 2.0, "int4": 4.0}
#: Bytes per value of each weight format (scales are counted by the caller).
PRECISIONS = ("fp16", "int8", "int4")
#: Weight-only INT8/INT4 kernels: vLLM's Marlin needs compute capability >= 7.5 since its
#: Turing support (vLLM PR #29901; `marlin_utils.py`: capability < 75 has no kernels), so of
#: the catalogue only the V100 (7.0) lacks them.
QUANT_MIN_SM = 7.5


class HardwareError(ValueError):
    """Bad hardware input; the message is one line naming the field."""


@dataclass(frozen=True)
class GpuClass:
    """One GPU model's datasheet numbers (dense, without structured sparsity).

    ``fp16_tflops`` is the tensor-core rate with FP32 accumulation (what
    PyTorch's FP16 GEMMs use); ``pcie_gb_s`` the host link per direction;
    ``alu_tflops`` the FP32 CUDA-core rate (dequantisation runs there).
    """

    name: str
    label: str
    fp16_tflops: float
    alu_tflops: float
    mem_gb: float
    mem_bw_gb_s: float
    pcie_gb_s: float
    sm: float
    source: str
    unified_memory: bool = False

    @property
    def precisions(self) -> tuple[str, ...]:
        return PRECISIONS if self.sm >= QUANT_MIN_SM else ("fp16",)


def _g(name, label, fp16, alu, mem, bw, pcie, sm, source, unified=False) -> GpuClass:
    return GpuClass(name, label, fp16, alu, mem, bw, pcie, sm, source, unified)


_AMPERE_WP = "NVIDIA Ampere GA102 GPU Architecture whitepaper v2.1 (2021), Table 9/Appendix A"
_ADA_WP = "NVIDIA Ada GPU Architecture whitepaper v2.1 (2023), Appendix A, Table 2"

#: Datasheet numbers (dense, FP16 tensor with FP32 accumulate); every row names
#: its source. Host links per direction after 128b/130b encoding (PCI-SIG):
#: Gen3 x16 15.75 GB/s, Gen4 x16 31.5, Gen5 x16 63; datasheets quote
#: bidirectional totals (32, 64, 128 GB/s). A30's FP32 rate is derived
#: (3584 CUDA cores x 2 x 1.44 GHz), Orin's FP16 tensor rate from its dense INT8
#: rate (85 TOPS = 170 sparse / 2) at half rate.
CATALOGUE: Mapping[str, GpuClass] = types.MappingProxyType({g.name: g for g in (
    _g("a2", "NVIDIA A2", 18.0, 4.5, 16, 200, 15.75, 8.6,
       "NVIDIA A2 Tensor Core GPU datasheet (2021): FP16 Tensor 18 TF dense (36 sparse), "
       "FP32 4.5 TF, 16 GB GDDR6, 200 GB/s, PCIe Gen4 x8"),
    _g("t4", "NVIDIA T4", 65.0, 8.1, 16, 300, 15.75, 7.5,
       "NVIDIA T4 datasheet (2019): mixed-precision FP16/FP32 65 TF, FP32 8.1 TF, 16 GB GDDR6, "
       "300 GB/s, PCIe Gen3 x16"),
    _g("v100", "NVIDIA V100 PCIe 32GB", 112.0, 14.0, 32, 900, 15.75, 7.0,
       "NVIDIA V100 datasheet (2020): Tensor 112 TF (PCIe), FP32 14 TF, 32 GB HBM2, 900 GB/s, "
       "PCIe Gen3 x16"),
    _g("rtx3090", "NVIDIA GeForce RTX 3090", 71.0, 35.6, 24, 936, 31.5, 8.6,
       _AMPERE_WP + ": FP16 Tensor with FP32 accumulate 71 TF dense, FP32 35.6 TF, 24 GB GDDR6X, "
       "936 GB/s, PCIe Gen4 x16"),
    _g("rtx4090", "NVIDIA GeForce RTX 4090", 165.2, 82.6, 24, 1008, 31.5, 8.9,
       _ADA_WP + ": FP16 Tensor with FP32 accumulate 165.2 TF dense, FP32 82.6 TF, 24 GB GDDR6X, "
       "1008 GB/s, PCIe Gen4 x16"),
    _g("a10", "NVIDIA A10", 125.0, 31.2, 24, 600, 31.5, 8.6,
       "NVIDIA A10 datasheet (2021): FP16 Tensor 125 TF dense (250 sparse), FP32 31.2 TF, "
       "24 GB GDDR6, 600 GB/s, PCIe Gen4 (64 GB/s bidirectional)"),
    _g("l4", "NVIDIA L4", 121.0, 30.3, 24, 300, 31.5, 8.9,
       "NVIDIA L4 datasheet (2023): FP16 Tensor 242 TF with sparsity (121 dense), FP32 30.3 TF, "
       "24 GB GDDR6, 300 GB/s, PCIe Gen4 x16 (64 GB/s bidirectional)"),
    _g("a30", "NVIDIA A30", 165.0, 10.3, 24, 933, 31.5, 8.0,
       "NVIDIA A30 datasheet (2021): FP16 Tensor 165 TF dense (330 sparse), FP32 10.3 TF, "
       "24 GB HBM2, 933 GB/s, PCIe Gen4 (64 GB/s bidirectional)"),
    _g("a40", "NVIDIA A40", 149.7, 37.4, 48, 696, 31.5, 8.6,
       "NVIDIA A40 datasheet (2021): FP16 Tensor 149.7 TF dense (299.4 sparse), FP32 37.4 TF, "
       "48 GB GDDR6, 696 GB/s, PCIe Gen4 x16 (64 GB/s bidirectional)"),
    _g("rtxa6000", "NVIDIA RTX A6000", 154.8, 38.7, 48, 768, 31.5, 8.6,
       "NVIDIA RTX A6000 datasheet (2021): Tensor 309.7 TF with sparsity (154.8 dense), FP32 "
       "38.7 TF, 48 GB GDDR6, 768 GB/s, PCIe Gen4 x16"),
    _g("orin64", "NVIDIA Jetson AGX Orin 64GB", 42.5, 5.3, 64, 204.8, 204.8, 8.7,
       "NVIDIA Jetson AGX Orin series datasheet (2023): GPU 170 sparse INT8 TOPS (42.5 dense "
       "FP16 Tensor TF = 170/4), 5.3 FP32 TF, 64 GB LPDDR5 at 204.8 GB/s shared with the CPU "
       "(unified memory: a 'load' is a copy within the same DRAM)", unified=True),
    _g("a100-40", "NVIDIA A100 PCIe 40GB", 312.0, 19.5, 40, 1555, 31.5, 8.0,
       "NVIDIA A100 datasheet (2021): FP16 Tensor 312 TF dense, FP32 19.5 TF, 40 GB HBM2 "
       "1555 GB/s, PCIe Gen4 (64 GB/s bidirectional)"),
    _g("a100-80", "NVIDIA A100 SXM 80GB", 312.0, 19.5, 80, 2039, 31.5, 8.0,
       "NVIDIA A100 datasheet (2021): FP16 Tensor 312 TF dense, FP32 19.5 TF, 80 GB HBM2e "
       "2039 GB/s (SXM), host link PCIe Gen4"),
    _g("h100-pcie", "NVIDIA H100 PCIe", 756.0, 51.0, 80, 2000, 63.0, 9.0,
       "NVIDIA H100 datasheet (2023): FP16 Tensor 1513 TF with sparsity (756 dense), FP32 51 TF, "
       "80 GB HBM2e 2 TB/s, PCIe Gen5 (128 GB/s bidirectional)"),
    _g("h100-sxm", "NVIDIA H100 SXM", 989.4, 67.0, 80, 3350, 63.0, 9.0,
       "NVIDIA H100 datasheet (2023): FP16 Tensor 1979 TF with sparsity (989.4 dense), FP32 "
       "67 TF, 80 GB HBM3 3.35 TB/s, PCIe Gen5"),
    _g("h200", "NVIDIA H200 SXM", 989.5, 67.0, 141, 4800, 63.0, 9.0,
       "NVIDIA H200 Tensor Core GPU datasheet (2024): FP16 Tensor 1979 TF with sparsity "
       "(989.5 dense), FP32 67 TF, 141 GB HBM3e 4.8 TB/s, PCIe Gen5 (128 GB/s bidirectional)"),
)})

#: Classes inside the paper's server ranges (Sec. VI-A: 18-120 TFLOPS, 12-48 GB
#: GPU memory, 12-64 GB/s PCIe), drawn by the topology generator. A40, RTX
#: A6000 and A10 are a little above 120 TFLOPS; they are the 48 GB and 24 GB
#: data-centre cards such edge sites run.
EDGE_CLASSES = ("a2", "t4", "rtx3090", "l4", "a10", "a40", "rtxa6000")


def gpu_class(name: str) -> GpuClass:
    """A catalogue entry by name (case-insensitive); HardwareError naming the valid ones."""
    key = name.strip().lower()
    try:
        return CATALOGUE[key]
    except KeyError:
        raise HardwareError(f"unknown GPU class {name!r}; known: {', '.join(CATALOGUE)}") from None


def nearest_class(tflops: float, mem_gb: float, among: tuple[str, ...] = EDGE_CLASSES) -> GpuClass:
    """The class closest in log FP16 TFLOPS and log memory (to derive what a file lacks)."""
    def dist(g: GpuClass) -> float:
        return math.log(g.fp16_tflops / tflops) ** 2 + math.log(g.mem_gb / mem_gb) ** 2
    return min((CATALOGUE[n] for n in among), key=lambda g: (dist(g), g.name))


@dataclass(frozen=True)
class Device:
    """Achieved rates of one device: what kernel times are computed from.

    ``from_class`` applies the global achieved fractions to a datasheet;
    a measured device (``testbed hardware calibrate-cpu``) gives achieved
    rates directly and may add a measured per-token-count GEMM profile.
    ``gemm_profile`` maps tokens -> (seconds per weight element) at a few
    aspect ratios (K/N); when present it replaces the roofline for GEMMs.
    """

    name: str
    flops: float  # achieved FP16 tensor (or measured GEMM) FLOP/s
    mem_bw: float  # achieved bytes/s
    alu: float  # achieved op/s for dequantisation
    launch_s: float = LAUNCH_S
    precisions: tuple[str, ...] = PRECISIONS
    elementwise_bw: float = 0.0  # bytes/s of element-wise ops; 0: mem_bw
    act_bytes: int = 2  # bytes per activation value (FP16 on GPUs, FP32 on a measured CPU)
    gemm_profile: tuple = field(default=(), compare=False)  # ((aspect, ((tokens, s/elem), ...)), ...)

    def __post_init__(self) -> None:
        for f in ("flops", "mem_bw", "alu"):
            v = getattr(self, f)
            if not (v > 0 and math.isfinite(v)):
                raise HardwareError(f"{self.name}: {f} must be positive and finite, got {v}")
        if not self.launch_s >= 0:
            raise HardwareError(f"{self.name}: launch_s must be >= 0")

    @classmethod
    def from_class(cls, g: GpuClass) -> "Device":
        return cls(name=g.name, flops=g.fp16_tflops * 1e12 * TENSOR_EFFICIENCY,
                   mem_bw=g.mem_bw_gb_s * 1e9 * MEM_EFFICIENCY,
                   alu=g.alu_tflops * 1e12 * ALU_EFFICIENCY, precisions=g.precisions)

    @classmethod
    def from_peaks(cls, name: str, tflops: float, mem_bw_gb_s: float, alu_tflops: float,
                   precisions: tuple[str, ...] = PRECISIONS) -> "Device":
        return cls(name=name, flops=tflops * 1e12 * TENSOR_EFFICIENCY,
                   mem_bw=mem_bw_gb_s * 1e9 * MEM_EFFICIENCY,
                   alu=alu_tflops * 1e12 * ALU_EFFICIENCY, precisions=precisions)

    def check_precision(self, precision: str) -> None:
        if precision not in self.precisions:
            raise HardwareError(f"{self.name}: precision {precision} is not supported (has "
                                f"{', '.join(self.precisions)}; weight-only INT8/INT4 kernels "
                                f"need compute capability >= {QUANT_MIN_SM})")

    # -- the roofline --------------------------------------------------------
    def kernel_s(self, flops: float, nbytes: float, dequant_ops: float = 0.0,
                 kernels: int = 1) -> float:
        """launch + max(compute + dequantisation, memory) for one fused piece of work."""
        comp = flops / self.flops + dequant_ops / self.alu
        mem = nbytes / self.mem_bw
        return kernels * self.launch_s + (comp if comp > mem else mem)

    def gemm_s(self, k: int, n: int, tokens: int, weight_bytes: float, dequant_ops: float) -> float:
        """One GEMM [tokens, k] x [k, n] whose weights take ``weight_bytes``."""
        if self.gemm_profile:
            return _interp_profile(self.gemm_profile, k / n, tokens) * k * n
        flops = 2.0 * tokens * k * n
        act = 2.0 * tokens * (k + n)
        return self.kernel_s(flops, weight_bytes + act, dequant_ops, kernels=0)


def _interp_profile(profile: tuple, aspect: float, tokens: int) -> float:
    """Seconds per weight element, log-linear in aspect ratio and token count."""
    la = math.log(aspect)
    rows = [(math.log(a), pts) for a, pts in profile]
    la = min(max(la, rows[0][0]), rows[-1][0])
    for i in range(len(rows)):
        if i == len(rows) - 1 or rows[i][0] <= la <= rows[i + 1][0]:
            j = min(i + 1, len(rows) - 1)
            w = 0.0 if j == i else (la - rows[i][0]) / (rows[j][0] - rows[i][0])
            return (1 - w) * _interp_tokens(rows[i][1], tokens) + w * _interp_tokens(rows[j][1], tokens)
    raise AssertionError("unreachable")  # pragma: no cover


def _interp_tokens(points: tuple, tokens: int) -> float:
    lt = math.log(max(1, tokens))
    pts = [(math.log(b), s) for b, s in points]
    if lt <= pts[0][0]:
        return pts[0][1]
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if lt <= b1:
            w = (lt - b0) / (b1 - b0)
            return s0 * (s1 / s0) ** w
    (b0, s0), (b1, s1) = pts[-2], pts[-1]  # beyond the grid: linear in tokens (compute-bound)
    return s1 * math.exp(lt - b1)


@dataclass(frozen=True)
class FfnShape:
    """An FFN (an expert, a shared expert or a dense block): d_model -> d_ff -> d_model."""

    d_model: int
    d_ff: int
    gated: bool = True

    def __post_init__(self) -> None:
        if self.d_model < 1 or self.d_ff < 1:
            raise HardwareError(f"ffn: d_model and d_ff must be >= 1, got {self.d_model}, {self.d_ff}")

    @property
    def matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def params(self) -> int:
        return self.matrices * self.d_model * self.d_ff

    def flops(self, tokens: int) -> float:
        return 2.0 * self.params * tokens

    def weight_bytes(self, precision: str) -> float:
        """Weights plus scales: INT8 one FP16 scale per output channel, INT4 one per 128 inputs
        (matches ``workloads.models.ModelSpec.expert_bytes``)."""
        p = self.params
        if precision == "fp16":
            return 2.0 * p
        up_out = (self.matrices - 1) * self.d_ff
        if precision == "int8":
            return p + 2.0 * (up_out + self.d_model)
        if precision == "int4":
            groups = up_out * math.ceil(self.d_model / 128) + self.d_model * math.ceil(self.d_ff / 128)
            return p / 2 + 2.0 * groups
        raise HardwareError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")

    def act_bytes(self, tokens: int) -> float:
        """FP16 activations written and read per token: x in, intermediates, y out."""
        return 2.0 * tokens * (2 * self.d_model + 2 * self.matrices * self.d_ff)


def ffn_launches(dev: Device, ffn: FfnShape) -> int:
    """Kernels ``ffn_seconds`` charges a launch for: a fused gate/up GEMM, the activation
    and the down GEMM on a GPU; each GEMM and two element-wise kernels on a measured device."""
    return ffn.matrices + 2 if dev.gemm_profile else 3


def ffn_seconds(dev: Device, ffn: FfnShape, tokens: int, precision: str = "fp16") -> float:
    """Time of one FFN over ``tokens`` tokens: its weights are read once, whatever ``tokens``."""
    if tokens < 1:
        return 0.0
    dev.check_precision(precision)
    wbytes = ffn.weight_bytes(precision)
    dq = DEQUANT_OPS[precision] * ffn.params
    if dev.gemm_profile:  # a measured device: its GEMM profile plus the element-wise kernels
        up = (ffn.matrices - 1) * dev.gemm_s(ffn.d_model, ffn.d_ff, tokens, 0.0, 0.0)
        down = dev.gemm_s(ffn.d_ff, ffn.d_model, tokens, 0.0, 0.0)
        # activation (and the gate product): read and write d_ff values per token each
        ew = dev.act_bytes * tokens * ffn.d_ff * (3 if ffn.gated else 2)
        bw = dev.elementwise_bw or dev.mem_bw
        return ffn_launches(dev, ffn) * dev.launch_s + up + down + ew / bw + dq / dev.alu
    return dev.kernel_s(ffn.flops(tokens), wbytes + ffn.act_bytes(tokens), dq,
                        kernels=ffn_launches(dev, ffn))

