"""Deployment (X, Y, c): where each expert replica lives, in which tier, at which precision.

A ``Deployment`` is the output of every router's ``place`` and the input of its
``route``. ``check`` verifies constraints (c.1)-(c.4) of problem P0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .system import FULL_PRECISION, Cluster, MoEShape, Precision


@dataclass(frozen=True, slots=True)
class Replica:
    """x_{E,n} = 1 with precision c_{E,n}; ``gpu`` is y_{E,n}."""

    expert: int
    server: int
    precision: Precision
    gpu: bool


@dataclass(frozen=True)
class MemoryBudget:
    """Per-server bytes available to expert replicas in each tier (G_n^M and C_n).

    GPU: ``gpu_share`` of G_n, minus the dense weights every server holds (the
    attention, router and shared expert of every layer, since any server may
    host a token); the rest of G_n is KV cache and activations. CPU:
    ``cpu_share`` of C_n. The shares are the knobs that decide how scarce GPU
    memory is, which the paper leaves implicit (see the README).
    """

    gpu: tuple[float, ...]
    cpu: tuple[float, ...]

    @classmethod
    def of(cls, cluster: Cluster, shape: MoEShape, gpu_share: float = 0.9,
           cpu_share: float = 0.9) -> "MemoryBudget":
        if not (0 <= gpu_share <= 1 and 0 < cpu_share <= 1):
            raise ValueError("gpu_share must be in [0, 1] and cpu_share in (0, 1]")
        dense = float(shape.dense_bytes) * shape.n_layers
        gpu = tuple(max(0.0, g * gpu_share - dense) for g in cluster.gpu_bytes)
        cpu = tuple(c * cpu_share for c in cluster.cpu_bytes)
        return cls(gpu=gpu, cpu=cpu)


class ConstraintViolation(ValueError):
    """A deployment breaks one of (c.1)-(c.4)."""


@dataclass(frozen=True)
class Deployment:
    """An immutable set of replicas with the lookups routers need."""

    replicas: tuple[Replica, ...]
    n_experts: int
    n_servers: int
    by_expert: tuple[tuple[int, ...], ...] = field(init=False, repr=False)
    by_server: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        per_e: list[list[int]] = [[] for _ in range(self.n_experts)]
        per_s: list[list[int]] = [[] for _ in range(self.n_servers)]
        seen = set()
        for i, r in enumerate(self.replicas):
            if not (0 <= r.expert < self.n_experts and 0 <= r.server < self.n_servers):
                raise ConstraintViolation(f"replica {r} is out of range")
            if (r.expert, r.server) in seen:
                raise ConstraintViolation(
                    f"expert {r.expert} has two replicas on server {r.server}")
            seen.add((r.expert, r.server))
            per_e[r.expert].append(i)
            per_s[r.server].append(i)
        object.__setattr__(self, "by_expert", tuple(tuple(x) for x in per_e))
        object.__setattr__(self, "by_server", tuple(tuple(x) for x in per_s))

    def replica_of(self, expert: int, server: int) -> int | None:
        for i in self.by_expert[expert]:
            if self.replicas[i].server == server:
                return i
        return None

    def full_precision(self, expert: int) -> tuple[int, ...]:
        """Indices of exact FP16 replicas of ``expert`` (the fallback set of c.4)."""
        return tuple(i for i in self.by_expert[expert]
                     if self.replicas[i].precision == FULL_PRECISION)

    def usage(self, shape: MoEShape) -> tuple[list[float], list[float]]:
        """Bytes used per server in (GPU, CPU)."""
        gpu = [0.0] * self.n_servers
        cpu = [0.0] * self.n_servers
        for r in self.replicas:
            v = shape.expert_bytes[r.precision]
            (gpu if r.gpu else cpu)[r.server] += v
        return gpu, cpu

    def total_bytes(self, shape: MoEShape) -> float:
        return float(sum(shape.expert_bytes[r.precision] for r in self.replicas))

    def check(self, shape: MoEShape, budget: MemoryBudget, cluster: Cluster | None = None) -> None:
        """Raise ``ConstraintViolation`` unless (c.1)-(c.4) hold; (c.3) holds by construction.
        With ``cluster``, also that every replica's precision has kernels on its server's GPU."""
        if cluster is not None:
            for r in self.replicas:
                if r.precision.label not in cluster.precisions[r.server]:
                    raise ConstraintViolation(
                        f"server {cluster.names[r.server]} ({cluster.gpu_class[r.server]}) has no "
                        f"{r.precision.label} kernels, but holds a replica of expert {r.expert} in it")
        gpu, cpu = self.usage(shape)
        for n in range(self.n_servers):
            if gpu[n] > budget.gpu[n] * (1 + 1e-9):
                raise ConstraintViolation(
                    f"(c.1) GPU memory of server {n}: {gpu[n]:.3e} > {budget.gpu[n]:.3e} bytes")
            if cpu[n] > budget.cpu[n] * (1 + 1e-9):
                raise ConstraintViolation(
                    f"(c.2) CPU memory of server {n}: {cpu[n]:.3e} > {budget.cpu[n]:.3e} bytes")
        for e in range(self.n_experts):
            if not self.full_precision(e):
                raise ConstraintViolation(f"(c.4) expert {e} has no full-precision exact replica")

    def summary(self, shape: MoEShape) -> dict:
        """Counts a run records beside its results."""
        per_prec = {p.label: 0 for p in Precision}
        for r in self.replicas:
            per_prec[r.precision.label] += 1
        n_gpu = sum(r.gpu for r in self.replicas)
        gpu_b = sum(shape.expert_bytes[r.precision] for r in self.replicas if r.gpu)
        return {
            "replicas": len(self.replicas),
            "replicas_per_expert": len(self.replicas) / max(1, self.n_experts),
            "gpu_resident": n_gpu,
            "by_precision": per_prec,
            "total_gib": self.total_bytes(shape) / 2**30,
            "gpu_gb": gpu_b / 1e9,
            "cpu_gb": (self.total_bytes(shape) - gpu_b) / 1e9,
        }
