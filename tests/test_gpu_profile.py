"""``hardware measure-gpu``'s measuring code, run on the CPU so CI exercises it."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from hetroute.hardware import Device, FfnShape, HardwareError, ffn_seconds, gpu_class
from hetroute.service import dense_seconds
from testbed import gpu_profile as gp
from testbed.cli import app
from workloads import get_model

H100 = Device.from_class(gpu_class("h100-sxm"))


@pytest.mark.parametrize("name, cls", [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
                                       ("NVIDIA A100-SXM4-80GB", "a100-80"), ("NVIDIA A10", "a10"),
                                       ("NVIDIA H200", "h200"), ("NVIDIA GeForce RTX 3090", "rtx3090"),
                                       ("Tesla T4", "t4"), ("Tesla V100-PCIE-32GB", "v100"),
                                       ("NVIDIA A100-PCIE-40GB", "a100-40"), ("NVIDIA A30", "a30")])
def test_device_names_map_to_their_catalogue_class(name, cls):
    assert gp.class_for(name) == cls


@pytest.mark.parametrize("name", ["Some Future Accelerator", "NVIDIA L40S", "NVIDIA A800"])
def test_an_unknown_device_asks_for_a_class(name):
    with pytest.raises(HardwareError, match="--gpu CLASS"):
        gp.class_for(name)


def test_ffn_rows_carry_the_model_with_and_without_launches():
    gen = torch.Generator().manual_seed(0)
    rows = gp.measure_ffn(torch.device("cpu"), H100, {"tiny": (64, 96, True), "relu": (64, 96, False)},
                          (1, 4), 3, gen, 1 << 16, dtype=torch.float32)
    assert [(r.shape, r.tokens, r.method) for r in rows] == [
        ("tiny", 1, "eager"), ("tiny", 4, "eager"), ("relu", 1, "eager"), ("relu", 4, "eager")]
    for r in rows:
        ffn = FfnShape(64, 96, r.shape == "tiny")
        assert r.model_ms == pytest.approx(ffn_seconds(H100, ffn, r.tokens) * 1e3)
        assert r.model_nolaunch_ms == pytest.approx(r.model_ms - 3 * H100.launch_s * 1e3)
        assert r.measured_ms > 0 and r.spread_ms >= 0 and r.ratio == r.model_ms / r.measured_ms


def test_the_computed_ffn_is_the_gated_mlp():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, generator=gen)
    w_in, w_out = gp._ffn_weights(FfnShape(8, 16, True), torch.float32, torch.device("cpu"), gen)
    want = (torch.nn.functional.silu(x @ w_in[:16].T) * (x @ w_in[16:].T)) @ w_out.T
    assert torch.allclose(gp.run_ffn(x, w_in, w_out, True), want, atol=1e-6)


def test_dense_rows_use_dense_seconds_and_int4_says_why_it_is_missing():
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cpu")
    rows = gp.measure_dense(dev, H100, 3, gen, 1 << 16, tokens=(2,), positions=(4,), dtype=torch.float32)
    shape = get_model("mixtral").shape()
    assert len(rows) == 1 and rows[0].model_ms == pytest.approx(dense_seconds(H100, shape, 2, 10, 8) * 1e3)
    int4 = gp.measure_int4(dev, H100, 3, gen, 1 << 16, shapes=("switch-expert",), tokens=(1,))
    if int4[0].note.startswith("unavailable"):  # the CPU build has no tinygemm kernel
        assert math.isnan(int4[0].measured_ms)
    else:
        assert int4[0].measured_ms > 0


def test_measure_gpu_without_cuda_is_one_line_and_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    res = CliRunner().invoke(app, ["hardware", "measure-gpu", "--out", str(tmp_path)])
    assert res.exit_code == 2
    assert "no CUDA device" in res.output and len(res.output.strip().splitlines()) == 1


def test_prefill_rows_charge_the_dense_part_and_the_step_rule():
    gen = torch.Generator().manual_seed(0)
    rows = gp.measure_prefill(torch.device("cpu"), H100, 3, gen, 1 << 16, model_name="switch",
                              requests=(2,), lengths=(4,), dtype=torch.float32)
    spec = get_model("switch")
    shape = spec.shape()
    dense = dense_seconds(H100, shape, 8, 2 * 4 * 5 // 2, 8)
    per = dense + 8 * ffn_seconds(H100, shape.expert_ffn, 8 * spec.top_k // 8)
    assert [(r.shape, r.tokens, r.positions) for r in rows] == [
        ("switch-base-8 dense", 8, 4), ("switch-base-8 layer", 8, 4)]
    assert rows[0].model_ms == pytest.approx(dense * 1e3)
    assert rows[1].model_ms == pytest.approx(per * 1e3) and rows[1].measured_ms > 0
