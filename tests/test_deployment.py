"""Deployment.check: constraints (c.1), (c.2) and (c.4) of P0, each on its own."""

from __future__ import annotations

import pytest

from hetroute.deployment import ConstraintViolation, Deployment, MemoryBudget, Replica
from hetroute.system import Precision

from . import factories as F

SH = F.shape(n_layers=1, experts=3, top_k=2)
V16 = float(SH.expert_bytes[Precision.FP16])
V4 = float(SH.expert_bytes[Precision.INT4])


def _dep(*reps: Replica) -> Deployment:
    return Deployment(tuple(reps), SH.n_experts, 2)


BASE = (Replica(0, 0, Precision.FP16, True), Replica(1, 0, Precision.FP16, False),
        Replica(2, 1, Precision.FP16, True), Replica(0, 1, Precision.INT4, False))


def test_a_deployment_within_budgets_passes():
    # server 0: GPU 1 x FP16, CPU 1 x FP16; server 1: GPU 1 x FP16, CPU 1 x INT4
    budget = MemoryBudget(gpu=(V16, V16), cpu=(V16, V4))  # exactly full: still allowed
    _dep(*BASE).check(SH, budget)


def test_c1_gpu_memory():
    budget = MemoryBudget(gpu=(V16, V16), cpu=(3 * V16, 3 * V16))
    reps = (Replica(0, 0, Precision.FP16, True), Replica(1, 0, Precision.INT4, True),
            Replica(1, 1, Precision.FP16, False), Replica(2, 1, Precision.FP16, False))
    with pytest.raises(ConstraintViolation, match=r"\(c\.1\).*server 0"):
        _dep(*reps).check(SH, budget)


def test_c2_cpu_memory_counts_only_cpu_resident_replicas():
    budget = MemoryBudget(gpu=(V16, V16), cpu=(V16, V16))
    reps = (Replica(0, 1, Precision.FP16, True), Replica(1, 1, Precision.FP16, False),
            Replica(2, 1, Precision.INT4, False), Replica(2, 0, Precision.FP16, False))
    with pytest.raises(ConstraintViolation, match=r"\(c\.2\).*server 1"):
        _dep(*reps).check(SH, budget)
    # the same replicas with expert 1's copy in the GPU tier (x(1-y) = 0): it leaves
    # (c.2) and server 1's CPU holds one INT4 copy
    ok = reps[:1] + (Replica(1, 1, Precision.FP16, True),) + reps[2:]
    _dep(*ok).check(SH, MemoryBudget(gpu=(V16, 2 * V16), cpu=(V16, V16)))


def test_c4_every_expert_has_a_full_precision_replica():
    budget = MemoryBudget(gpu=(4 * V16, 4 * V16), cpu=(4 * V16, 4 * V16))
    reps = (Replica(0, 0, Precision.FP16, True), Replica(1, 0, Precision.INT8, True),
            Replica(1, 1, Precision.INT4, False), Replica(2, 1, Precision.FP16, False))
    with pytest.raises(ConstraintViolation, match=r"\(c\.4\) expert 1"):
        _dep(*reps).check(SH, budget)
