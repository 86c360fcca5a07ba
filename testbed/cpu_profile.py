"""Measure this machine's CPU as a device of the hardware model (``testbed hardware calibrate-cpu``).

The only real processor every user of this testbed has is a CPU, so it is
where the hardware model (``hetroute.hardware``) can be checked against real
kernels on every machine: the emulated workers run their expert kernels on it.
What is measured (PyTorch, FP32, one thread by default, weights in pools
larger than the last-level cache so every read comes from DRAM, as an MoE
server's do when it cycles through many experts):

- a GEMM profile: seconds per weight element of [b, K] x [K, N] at b = 1-512
  tokens and five aspect ratios K/N (1/4 .. 4) of ~4 M weights. Like Vidur's
  profiled operators, it is the device's achieved rate as a function of the
  batch; a CPU's small-batch GEMM efficiency is too irregular for two
  constants (see the README);
- the achieved GEMM FLOP/s at 512 tokens, the GEMV memory bandwidth, the
  bandwidth of element-wise kernels and the per-operator overhead.

The test shapes of ``tests/test_hardware_cpu.py`` are none of the profiled
ones: the model predicts FFNs from GEMMs of other sizes.
"""

from __future__ import annotations

import math
import platform
import statistics
import time

import torch

from hetroute.hardware import Device

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ASPECTS = (0.25, 0.5, 1.0, 2.0, 4.0)
PROFILE_WEIGHTS = 4 * 2**20
POOL_BYTES = 96e6  # larger than the last-level cache of common server CPUs


def _median_s(fn, reps: int = 5) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _pool(k: int, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    count = max(2, int(POOL_BYTES / (k * n * 4)) + 1)
    return [torch.randn(k, n, generator=gen) for _ in range(count)]


def gemm_seconds(k: int, n: int, tokens: int, gen: torch.Generator, reps: int = 5) -> float:
    """Seconds of one [tokens, k] x [k, n] GEMM with cold weights (median)."""
    pool = _pool(k, n, gen)
    x = torch.randn(tokens, k, generator=gen)
    return _median_s(lambda: [x @ w for w in pool], reps) / len(pool)


def measure_cpu(threads: int = 1, reps: int = 5, seed: int = 0) -> dict:
    """Measure the device parameters; a JSON-ready dict (see ``device_from``)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    profile = []
    for a in ASPECTS:
        k = int(round(math.sqrt(PROFILE_WEIGHTS * a) / 64)) * 64
        n = PROFILE_WEIGHTS // k
        pts = [(b, gemm_seconds(k, n, b, gen, reps) / (k * n)) for b in TOKENS]
        profile.append((k / n, pts))
    k = n = 2048
    t = gemm_seconds(k, n, 512, gen, reps)
    flops = 2.0 * 512 * k * n / t
    t1 = gemm_seconds(k, n, 1, gen, reps)
    mem_bw = 4.0 * k * n / t1
    x, y = torch.randn(256, 8192, generator=gen), torch.randn(256, 8192, generator=gen)
    ew = _median_s(lambda: torch.nn.functional.silu(x) * y, reps)
    ew_bw = 3 * 4 * x.numel() / ew
    a, b = torch.randn(1, 64, generator=gen), torch.randn(64, 64, generator=gen)
    launch = _median_s(lambda: [a @ b for _ in range(2000)], reps) / 2000
    return {"name": f"cpu:{platform.processor() or platform.machine()}", "threads": threads,
            "torch": torch.__version__, "flops": flops, "mem_bw": mem_bw, "elementwise_bw": ew_bw,
            "launch_s": launch, "gemm_profile": profile}


class ReferenceGemm:
    """The profile's square GEMM (aspect 1, ~4 M weights), timed again beside a measurement.

    A shared VM's CPU speed drifts by tens of percent within minutes, and other jobs
    take the cores in bursts (README, Tests). ``ratio`` times a kernel and this GEMM in
    alternation, pass by pass, and returns the median of their ratios: the kernel's time
    in units of the reference's, which drift and bursts longer than a pass cancel from.
    A check of the model compares it with the prediction in the same units (the
    prediction over the reference's time at calibration). The GEMM is one the model was
    calibrated on, so the ratio carries no information about the shapes being checked.
    """

    def __init__(self, calibration: dict, gen: torch.Generator) -> None:
        aspect, pts = min(calibration["gemm_profile"], key=lambda ap: abs(math.log(ap[0])))
        self.k = int(round(math.sqrt(PROFILE_WEIGHTS * aspect) / 64)) * 64
        self.n = PROFILE_WEIGHTS // self.k
        self.calibrated = {int(b): s * self.k * self.n for b, s in pts}  # seconds per GEMM
        self.pool = _pool(self.k, self.n, gen)
        self.gen = gen

    def ratio(self, kernel, tokens: int, passes: int = 9) -> tuple[float, float]:
        """(median of kernel / reference time over alternating passes, median of the
        reference's time now over its time at calibration); ``kernel()`` runs one pass
        and returns how many kernels it ran."""
        x = torch.randn(tokens, self.k, generator=self.gen)
        ref_pass = lambda: [x @ w for w in self.pool]  # noqa: E731
        kernel(), ref_pass()  # warm
        ratios, speeds = [], []
        for _ in range(passes):
            t = time.perf_counter()
            n = kernel()
            t_k = (time.perf_counter() - t) / n
            t = time.perf_counter()
            ref_pass()
            t_r = (time.perf_counter() - t) / len(self.pool)
            ratios.append(t_k / t_r)
            speeds.append(t_r / self.calibrated[tokens])
        return statistics.median(ratios), statistics.median(speeds)


def device_from(d: dict) -> Device:
    """The measured CPU as a ``Device``: achieved rates, FP32 weights and activations."""
    return Device(name=d["name"], flops=d["flops"], mem_bw=d["mem_bw"], alu=d["flops"],
                  launch_s=d["launch_s"], precisions=("fp16",), elementwise_bw=d["elementwise_bw"],
                  act_bytes=4,
                  gemm_profile=tuple((a, tuple((int(b), s) for b, s in pts))
                                     for a, pts in d["gemm_profile"]))


def ffn_weights(d_model: int, d_ff: int, gated: bool, gen: torch.Generator) -> list[list[torch.Tensor]]:
    m = 3 if gated else 2
    count = max(2, int(POOL_BYTES / (m * d_model * d_ff * 4)) + 1)
    return [[torch.randn(d_model, d_ff, generator=gen) if i < m - 1 else
             torch.randn(d_ff, d_model, generator=gen) for i in range(m)] for _ in range(count)]


def ffn_forward(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The expert FFN as the emulated workers run it: SwiGLU (3 matrices) or ReLU (2)."""
    if len(ws) == 3:
        g, u, d = ws
        return (torch.nn.functional.silu(x @ g) * (x @ u)) @ d
    u, d = ws
    return torch.relu(x @ u) @ d


def ffn_pass(d_model: int, tokens: int, pool: list, gen: torch.Generator):
    """One pass of the FFN over every weight set of ``pool`` (cold weights); returns a
    callable that runs it and returns the number of FFNs run."""
    x = torch.randn(tokens, d_model, generator=gen)

    def run() -> int:
        for ws in pool:
            ffn_forward(ws, x)
        return len(pool)
    return run
