"""Service times of a server's stream, under one of two models.

- ``paper``: the paper's cost model (Sec. III-D, eq. 9): an expert job costs
  w_E / F_n per token, the dense part dense FLOPs / F_n per token, a
  CPU-resident replica v(c) / beta_n per use. Work is additive in tokens.
- ``hardware``: the roofline of ``hetroute.hardware`` on each server's GPU
  class: a batch of b tokens through one expert reads all its weights once,
  so its time is nearly flat in b until compute binds; the dense part reads
  the dense weights once per batch plus each request's KV cache; a
  CPU-resident replica crosses PCIe at the achieved fraction of the link.

The same classes serve two users that must stay apart: the backends' world
(``spec.physics``) and each router's belief (``router.params.cost_model``).
"""

from __future__ import annotations

from .hardware import Device, ffn_launches, ffn_seconds
from .system import Cluster, MoEShape, Precision

MODELS = ("paper", "hardware")
#: Achieved share of the PCIe link for host-to-device copies: 81-84% measured on
#: A100 (Gen4 x16) and V100 (Gen3 x16) by CSCS's ReFrame reference values
#: (reframe-hpc/reframe, cscs-checks/microbenchmarks/gpu/memory_bandwidth).
PCIE_EFFICIENCY = 0.8
#: Dense-part times a HardwareService keeps (a step scheduler asks for the same few
#: (tokens, positions) again and again); the memo starts over when full.
DENSE_MEMO = 1 << 16


def dense_seconds(dev: Device, shape: MoEShape, tokens: int, attn_positions: int = 0,
                  kv_positions: int = 0) -> float:
    """The dense part of one layer on ``dev`` by the roofline: its weights read once per
    batch, each attended position's scores and context, the KV cache read, activations."""
    if tokens < 1:
        return 0.0
    flops = tokens * shape.dense_flops + attn_positions * shape.attn_flops_per_position
    nbytes = (shape.dense_bytes + kv_positions * shape.kv_bytes_per_token
              + 16.0 * tokens * shape.d_model)
    return dev.kernel_s(flops, nbytes, kernels=shape.dense_kernels)


class ServiceModel:
    """Seconds of stream time; ``tokens`` is the batch one kernel serves."""

    name = "base"

    def __init__(self, cluster: Cluster, shape: MoEShape) -> None:
        self.cluster, self.shape = cluster, shape

    def expert_s(self, server: int, precision: Precision, tokens: int = 1) -> float:
        raise NotImplementedError

    def dense_s(self, server: int, tokens: int = 1, attn_positions: int = 0,
                kv_positions: int = 0) -> float:
        """The dense part of one layer for ``tokens`` tokens that attend to
        ``attn_positions`` positions in all and read ``kv_positions`` cached ones."""
        raise NotImplementedError

    def load_s(self, server: int, precision: Precision) -> float:
        """Moving one replica's weights from CPU to GPU memory."""
        raise NotImplementedError

    def expert_launch_s(self, server: int) -> float:
        """The launch part of ``expert_s`` (what a fused-MoE step pays once, not per replica)."""
        return 0.0

    def marginal_s(self, server: int, precision: Precision, batch: int) -> float:
        """What one more token adds to a batch of ``batch`` tokens of one expert."""
        return self.expert_s(server, precision, batch + 1) - self.expert_s(server, precision, batch)


class PaperService(ServiceModel):
    """Eq. (9)'s terms: w/F per token, v/beta per load, dense FLOPs/F per token."""

    name = "paper"

    def __init__(self, cluster: Cluster, shape: MoEShape) -> None:
        super().__init__(cluster, shape)
        self._comp = [shape.expert_flops / f for f in cluster.flops]
        self._dense = [shape.dense_flops / f for f in cluster.flops]

    def expert_s(self, server: int, precision: Precision, tokens: int = 1) -> float:
        return tokens * self._comp[server]

    def dense_s(self, server: int, tokens: int = 1, attn_positions: int = 0,
                kv_positions: int = 0) -> float:
        return tokens * self._dense[server]

    def load_s(self, server: int, precision: Precision) -> float:
        return self.shape.expert_bytes[precision] / self.cluster.pcie[server]


class HardwareService(ServiceModel):
    """The roofline on each server's GPU class (memoised per batch size)."""

    name = "hardware"

    def __init__(self, cluster: Cluster, shape: MoEShape) -> None:
        super().__init__(cluster, shape)
        self.devices: list[Device] = [cluster.device(n) for n in range(cluster.n)]
        #: [server][precision] -> times by token count, filled on demand
        self._memo: list[list[list[float]]] = [[[0.0] for _ in Precision] for _ in range(cluster.n)]
        self._dense_memo: dict[tuple[int, int, int, int], float] = {}

    def expert_s(self, server: int, precision: Precision, tokens: int = 1) -> float:
        tab = self._memo[server][precision]
        if tokens >= len(tab):
            dev, ffn, label = self.devices[server], self.shape.expert_ffn, Precision(precision).label
            tab.extend(ffn_seconds(dev, ffn, b, label) for b in range(len(tab), tokens + 1))
        return tab[tokens]

    def expert_launch_s(self, server: int) -> float:
        dev = self.devices[server]
        return ffn_launches(dev, self.shape.expert_ffn) * dev.launch_s

    def dense_s(self, server: int, tokens: int = 1, attn_positions: int = 0,
                kv_positions: int = 0) -> float:
        key = (server, tokens, attn_positions, kv_positions)
        memo = self._dense_memo
        got = memo.get(key)
        if got is None:
            if len(memo) >= DENSE_MEMO:
                memo.clear()
            got = memo[key] = self._dense_s(server, tokens, attn_positions, kv_positions)
        return got

    def _dense_s(self, server: int, tokens: int, attn_positions: int, kv_positions: int) -> float:
        return dense_seconds(self.devices[server], self.shape, tokens, attn_positions, kv_positions)

    def load_s(self, server: int, precision: Precision) -> float:
        return self.shape.expert_bytes[precision] / (self.cluster.pcie[server] * PCIE_EFFICIENCY)


def make_service(name: str, cluster: Cluster, shape: MoEShape) -> ServiceModel:
    if name == "paper":
        return PaperService(cluster, shape)
    if name == "hardware":
        return HardwareService(cluster, shape)
    raise ValueError(f"unknown service model {name!r}; one of {', '.join(MODELS)}")
