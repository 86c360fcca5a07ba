"""The hardware model against kernels measured on a real GPU.

``docs/measurements/`` holds two runs of ``python -m testbed hardware measure-gpu``
on each of an H100 SXM (80 GB HBM3) and an H200. These tests recompute the model's
predictions with the code as it is now and hold them to what the GPU did, so a
change of a constant or a rule that moves the model away from that hardware fails
here. Bounds are the measured spread plus a margin, not tuned to pass: the README
("Measured on a real GPU") gives every ratio.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from hetroute.hardware import Device, FfnShape, ffn_seconds, gpu_class
from hetroute.service import HardwareService, dense_seconds
from hetroute.system import Precision
from testbed.gpu_profile import SHAPES
from testbed.steps import Job, StepScheduler
from topologies import parse_topology
from workloads import get_model

MEASUREMENTS = Path(__file__).resolve().parent.parent / "docs" / "measurements"
#: record folder -> (the device's name, its catalogue class)
RECORDS = {"h100-2026-11-27": ("NVIDIA H100 80GB HBM3", "h100-sxm"),
           "h200-2026-11-27": ("NVIDIA H200", "h200")}
KEYS = ["part", "shape", "method", "precision", "tokens", "experts", "positions"]


def _load(name: str) -> tuple[pd.DataFrame, str]:
    """Both runs, averaged per point (their graph timings agree within 1% at the median),
    and the catalogue class the model predicts them with."""
    folder = MEASUREMENTS / name
    env = json.loads((folder / "env-run1.json").read_text())
    assert (env["name"], env["catalogue_class"]) == RECORDS[name]
    files = [folder / f"kernels-run{k}.csv" for k in (1, 2)] + sorted(folder.glob("prefill-run*.csv"))
    df = pd.concat([pd.read_csv(f) for f in files])
    return df.groupby(KEYS, as_index=False).measured_ms.mean(), env["catalogue_class"]


@pytest.fixture(scope="module", params=sorted(RECORDS))
def record(request) -> tuple[pd.DataFrame, str]:
    return _load(request.param)


@pytest.fixture(scope="module")
def rec(record) -> pd.DataFrame:
    return record[0]


@pytest.fixture(scope="module")
def dev(record) -> Device:
    return Device.from_class(gpu_class(record[1]))


def _ffn_ratio(rows: pd.DataFrame, dev: Device) -> pd.Series:
    model = [ffn_seconds(dev, FfnShape(*SHAPES[s]), int(b)) * 1e3
             for s, b in zip(rows["shape"], rows["tokens"])]
    return pd.Series(model, index=rows.index) / rows.measured_ms


def test_large_experts_are_within_20_percent_while_memory_bound(rec, dev):
    """Mixtral's expert and Llama-2-7B's MLP (270-352 MB) as CUDA graphs: the weight read
    the model charges is what the GPU does at 1-128 tokens; beyond, the roofline's max is
    optimistic in and past the transition (measured 0.76-0.96)."""
    rows = rec[(rec.part == "ffn") & (rec.method == "graph")
               & rec["shape"].isin(["mixtral-expert", "llama2-7b-mlp"])]
    r = _ffn_ratio(rows, dev)
    small = rows.tokens <= 128
    assert len(r) == 26
    assert r[small].between(0.85, 1.20).all(), r[small].round(3).tolist()
    assert r[~small].between(0.72, 1.0).all(), r[~small].round(3).tolist()


def test_every_ffn_shape_is_within_45_percent_as_a_cuda_graph(rec, dev):
    """Small experts (Qwen's 17 MB, Switch's 4.7 MB) are dominated by per-kernel fixed
    costs, which the model's 5 us per launch over-charges by up to 42%."""
    rows = rec[(rec.part == "ffn") & (rec.method == "graph")]
    r = _ffn_ratio(rows, dev)
    assert len(r) == 65
    assert r.between(0.75, 1.45).all(), rows.assign(r=r)[r.lt(0.75) | r.gt(1.45)].to_string()


def test_a_decode_layers_dense_part_is_within_25_percent(rec, dev):
    """RMSNorms, QKV, a KV-cache append, attention over 128-4096 cached positions, the
    output projection and the router, for 1-128 sequences, against dense_seconds."""
    shape = get_model("mixtral").shape()
    rows = rec[(rec.part == "dense") & (rec.method == "graph")]
    model = [dense_seconds(dev, shape, int(b), int(b) * (int(p) + 1), int(b) * int(p)) * 1e3
             for b, p in zip(rows.tokens, rows.positions)]
    r = pd.Series(model, index=rows.index) / rows.measured_ms
    assert len(r) == 12
    assert r.between(0.80, 1.25).all(), r.round(3).tolist()


def test_the_model_s_achieved_fractions_are_conservative_on_this_gpu(record):
    """Copy bandwidth, a large FP16 GEMM and pinned host-to-device copies reach more of
    the datasheet than the global fractions assume (by 6-18% on these two GPUs)."""
    rec, cls = record
    ceil = rec[(rec.part == "ceiling") & (rec.method == "eager")].set_index("shape").measured_ms
    g = gpu_class(cls)
    copy_gb_s = 2 * 2.0 * (1 << 28) / (ceil["copy d2d GB/s"] / 1e3) / 1e9
    tflops = 2.0 * 8192 ** 3 / (ceil["gemm 8192^3 TFLOP/s"] / 1e3) / 1e12
    from hetroute.hardware import MEM_EFFICIENCY, TENSOR_EFFICIENCY
    from hetroute.service import PCIE_EFFICIENCY
    assert MEM_EFFICIENCY < copy_gb_s / g.mem_bw_gb_s < MEM_EFFICIENCY * 1.25
    assert TENSOR_EFFICIENCY < tflops / g.fp16_tflops < TENSOR_EFFICIENCY * 1.25
    ffn = FfnShape(*SHAPES["mixtral-expert"])
    h2d = ffn.weight_bytes("fp16") / (ceil["h2d expert load GB/s"] / 1e3) / 1e9
    assert PCIE_EFFICIENCY < h2d / g.pcie_gb_s < PCIE_EFFICIENCY * 1.25


def _step_s(cls: str, model: str, experts: int, tokens: int, moe_kernels: str) -> float:
    """The world's duration of one step of ``experts`` replicas with ``tokens`` tokens each
    on a server of class ``cls`` (the step rule of testbed/steps.py)."""
    topo = parse_topology({"name": "two", "servers": [
        {"name": "a", "gpu": cls, "cpu_mem_gb": 512}, {"name": "b", "gpu": cls, "cpu_mem_gb": 512}],
        "links": [{"src": "a", "dst": "b", "bandwidth_gbps": 10, "delay_ms": 1, "symmetric": True}]},
        "two.yaml")
    svc = HardwareService(topo.to_cluster(), get_model(model).shape())
    sc = StepScheduler(svc, 0, lambda r: Precision.FP16, lambda r: True, scope="layer",
                       moe_kernels=moe_kernels)
    for r in range(experts):
        for t in range(tokens):
            sc.submit(Job(0, r, t, t, 0, 0.0))
    return sc.take(0.0).duration * 1e3


@pytest.mark.parametrize("model, shape", [("mixtral", "mixtral-expert"), ("qwen", "qwen-expert")])
def test_the_step_rule_against_measured_steps_of_many_experts(record, model, shape):
    """E different experts of b tokens each. Per-expert launches match experts run back to
    back as a CUDA graph; fused launches match grouped GEMMs, which Qwen's many small
    experts need (60 experts of one token: 0.41 ms grouped, 0.94 ms back to back)."""
    rec, cls = record
    steps = rec[(rec.part == "step") & (rec["shape"] == shape)]
    seen = 0
    for (e, b), g in steps.groupby(["experts", "tokens"]):
        by = g.set_index("method").measured_ms
        best = min(by["graph"], by["grouped"])
        per, fused = _step_s(cls, model, e, b, "per_expert"), _step_s(cls, model, e, b, "fused")
        assert 0.8 < per / by["graph"] < 1.45, (e, b, per, by["graph"])
        # few experts: a grouped GEMM's fixed cost (~30 us) exceeds the launches the fused
        # rule keeps, so it is up to 40% optimistic at four experts (H200)
        assert 0.55 < fused / best < 1.45, (e, b, fused, best)
        if shape == "qwen-expert" and e == 60:  # the per-expert rule over-charges fused engines
            assert per / best > 2.5
        seen += 1
    assert seen == 12


def test_a_prompt_step_through_a_whole_layer(record):
    """R prompts of L tokens through Mixtral's dense part (causal attention) and then its
    eight experts (top-2, gathered and scattered back, one expert after another): the
    paper's workload."""
    rec, cls = record
    rows = rec[rec.part == "prefill"]
    dev = Device.from_class(gpu_class(cls))
    shape = get_model("mixtral").shape()
    seen = 0
    for row in rows.itertuples():
        L, T = int(row.positions), int(row.tokens)
        dense = dense_seconds(dev, shape, T, T // L * L * (L + 1) // 2, T)
        if row.shape.endswith("dense"):
            assert 0.8 < dense * 1e3 / row.measured_ms < 1.05, row
        else:
            per = dense + 8 * ffn_seconds(dev, shape.expert_ffn, T * 2 // 8)
            assert 0.72 < per * 1e3 / row.measured_ms < 1.1, row
        seen += 1
    assert seen == 12
