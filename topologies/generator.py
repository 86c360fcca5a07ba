"""Seeded generator for topologies in the ranges of the paper's Section VI-A.

Servers are real GPU classes drawn uniformly from ``EDGE_CLASSES`` (the
catalogue classes in or near the paper's ranges, ``hetroute.hardware``), so
every server's F_n, G_n, beta_n and memory bandwidth come from one datasheet;
CPU memory is drawn uniformly in its range. Links come from a 2-D
geographic embedding: one-way delay is a fixed floor (the low end of the
range) plus a part proportional to distance, scaled so the farthest pair gets
the high end; a metric plus a constant is still a metric, so delays obey the
triangle inequality as Internet latencies roughly do. Bandwidth is log-uniform per pair, with each direction within
20% of the other, as access links are often asymmetric.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from hetroute.hardware import EDGE_CLASSES

from .schema import LinkSpec, ServerSpec, TopologySpec


@dataclass(frozen=True)
class Ranges:
    """The paper's ranges (Section VI-A); servers are drawn as whole GPU classes."""

    gpu_classes: tuple[str, ...] = EDGE_CLASSES
    cpu_mem_gb: tuple[float, float] = (96.0, 512.0)
    bandwidth_gbps: tuple[float, float] = (0.8, 10.0)
    delay_ms: tuple[float, float] = (0.3, 22.0)


def generate(n_servers: int, seed: int, name: str | None = None,
             ranges: Ranges = Ranges()) -> TopologySpec:
    if n_servers < 1:
        raise ValueError("n_servers must be >= 1")
    rng = np.random.default_rng(seed)

    def uni(lo_hi: tuple[float, float], size: int | None = None):
        return rng.uniform(*lo_hi, size=size)

    servers = [
        ServerSpec(name=f"s{i}", gpu=str(rng.choice(ranges.gpu_classes)),
                   cpu_mem_gb=round(float(uni(ranges.cpu_mem_gb)), 0))
        for i in range(n_servers)
    ]
    pos = rng.uniform(0, 1, size=(n_servers, 2))
    dist = np.linalg.norm(pos[:, None, :] - pos[None, :, :], axis=-1)
    off = dist[~np.eye(n_servers, dtype=bool)]
    dmax = off.max() if off.size else 1.0
    lo, hi = ranges.delay_ms
    bl, bh = (math.log(x) for x in ranges.bandwidth_gbps)
    links = []
    for a in range(n_servers):
        for b in range(a + 1, n_servers):
            delay = round(lo + dist[a, b] / dmax * (hi - lo), 2)
            base = math.exp(rng.uniform(bl, bh))
            for s, d in ((a, b), (b, a)):
                bw = min(ranges.bandwidth_gbps[1],
                         max(ranges.bandwidth_gbps[0], base * rng.uniform(0.8, 1.0)))
                links.append(LinkSpec(src=f"s{s}", dst=f"s{d}", bandwidth_gbps=round(bw, 2),
                                      delay_ms=delay))
    return TopologySpec(
        name=name or f"gen{n_servers}-seed{seed}",
        description=f"generated: {n_servers} servers in the paper's ranges (seed {seed})",
        generator={"n_servers": n_servers, "seed": seed,
                   "ranges": {k: list(v) for k, v in asdict(ranges).items()}},
        servers=servers, links=links)
