"""Model catalogue, request shapes, arrivals, users and calibration traffic."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import workloads
from hetroute.placement.calibration import CalibrationTraffic
from hetroute.system import MoEShape, Precision
from workloads.models import MODELS, get_model
from workloads.requests import (
    Request,
    RequestShape,
    Users,
    calibration_traffic,
    generate_requests,
    poisson_arrivals,
)
from workloads.traces import CALIBRATION_ID_BASE, Routing, SyntheticTrace

MIXTRAL, QWEN, SWITCH = get_model("mixtral"), get_model("qwen"), get_model("switch")


# --- model catalogue -------------------------------------------------------
def test_mixtral_fp16_expert_is_exactly_three_4096x14336_matrices():
    assert MIXTRAL.expert_bytes(Precision.FP16) == 3 * 4096 * 14336 * 2 == 352_321_536
    assert MIXTRAL.expert_flops() == 2 * 3 * 4096 * 14336


def test_quantized_sizes_follow_the_stated_layouts():
    # INT8: 1 B/weight + an fp16 scale per output channel (w1, w3: 14336 each; w2: 4096).
    assert MIXTRAL.expert_bytes(Precision.INT8) == 3 * 4096 * 14336 + 2 * (2 * 14336 + 4096)
    for m in MODELS.values():
        p = m.expert_params()
        # INT4 g128: 0.5 B/weight + 2 B per 128 weights = 0.515625 B/weight.
        assert m.expert_bytes(Precision.INT4) / p == pytest.approx(0.515625)
        assert m.expert_bytes(Precision.INT4) < m.expert_bytes(Precision.INT8) < m.expert_bytes(Precision.FP16)


@pytest.mark.parametrize("model, total, active", [
    (MIXTRAL, 46.7e9, 12.9e9),  # Mixtral paper / HF card: 46.7B total, 12.9B active
    (QWEN, 14.3e9, 2.7e9),      # Qwen1.5-MoE-A2.7B card: 14.3B total, 2.7B activated
    (SWITCH, 0.62e9, None),
])
def test_parameter_counts_match_published_totals(model, total, active):
    assert model.total_params() == pytest.approx(total, rel=0.01)
    if active is not None:
        assert model.active_params() == pytest.approx(active, rel=0.01)


def test_architecture_numbers():
    assert (MIXTRAL.n_layers, MIXTRAL.experts_per_layer, MIXTRAL.top_k, MIXTRAL.d_model) == (32, 8, 2, 4096)
    assert (MIXTRAL.n_heads, MIXTRAL.n_kv_heads, MIXTRAL.head_dim) == (32, 8, 128)
    assert (QWEN.n_layers, QWEN.experts_per_layer, QWEN.top_k, QWEN.d_model) == (24, 60, 4, 2048)
    assert (QWEN.expert_d_ff, QWEN.shared_expert_d_ff, QWEN.n_kv_heads) == (1408, 5632, 16)
    assert (SWITCH.n_layers, SWITCH.experts_per_layer, SWITCH.top_k, SWITCH.d_model) == (12, 8, 1, 768)
    assert (SWITCH.expert_d_ff, SWITCH.expert_matrices) == (3072, 2)


def test_qwen_shared_expert_and_gate_are_in_the_dense_part():
    without = dataclasses.replace(QWEN, shared_expert_d_ff=0)
    shared = 3 * 2048 * 5632 + 2048  # SwiGLU shared expert + its Linear(2048, 1) gate
    assert QWEN.dense_params() - without.dense_params() == shared
    assert QWEN.dense_flops() - without.dense_flops() == 2 * shared
    assert QWEN.dense_bytes() - without.dense_bytes() == 2 * shared


def test_mixtral_dense_flops_use_the_real_gqa_shapes():
    attention = 4096 * (4096 + 2 * 8 * 128) + 4096 * 4096  # q, k, v (8 KV heads), o
    router = 4096 * 8
    assert MIXTRAL.dense_flops() == 2 * (attention + router)
    assert MIXTRAL.dense_bytes() == 2 * (attention + router + 2 * 4096)  # + 2 RMSNorms


def test_shape_conversion():
    for m in MODELS.values():
        s = m.shape()
        assert isinstance(s, MoEShape)
        assert (s.name, s.n_layers, s.experts_per_layer, s.top_k, s.d_model) == (
            m.name, m.n_layers, m.experts_per_layer, m.top_k, m.d_model)
        assert s.expert_flops == m.expert_flops()
        assert dict(s.expert_bytes) == {c: m.expert_bytes(c) for c in Precision}
        assert s.hidden_bytes == 2 * m.d_model
        assert s.dense_flops == m.dense_flops() > 0 and s.dense_bytes == m.dense_bytes() > 0
        assert s.n_experts == m.n_layers * m.experts_per_layer
        with pytest.raises(TypeError):
            s.expert_bytes[Precision.FP16] = 0  # read-only mapping


def test_get_model_names_aliases_and_error():
    assert get_model("mixtral") is get_model("Mixtral-8x7B") is MODELS["mixtral-8x7b"]
    assert get_model("qwen").name == "qwen1.5-moe-a2.7b"
    assert get_model("switch").name == "switch-base-8"
    with pytest.raises(KeyError) as err:
        get_model("gpt-4")
    for valid in ("switch-base-8", "qwen1.5-moe-a2.7b", "mixtral-8x7b", "mixtral"):
        assert valid in str(err.value)


def test_catalogue_is_immutable():
    with pytest.raises(TypeError):
        MODELS["x"] = MIXTRAL  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        MIXTRAL.top_k = 3  # type: ignore[misc]


def test_package_reexports_lazily():
    assert workloads.SyntheticTrace is SyntheticTrace
    assert "calibration_traffic" in workloads.__all__
    with pytest.raises(AttributeError):
        workloads.nothing_here  # noqa: B018


# --- requests ----------------------------------------------------------------
def test_request_shape_default_is_the_papers_prompt_then_decode():
    shape = RequestShape()
    assert (shape.prompt_tokens, shape.gen_tokens, shape.n_tokens) == (36, 32, 68)
    assert 1490 / 40 == pytest.approx(shape.prompt_tokens, abs=1.5)  # paper: tokens/s over requests/s
    assert 229_711 / 203_068 == pytest.approx(36 / 32, abs=0.01)  # ShareGPT, vLLM PR #18566: 1.13:1
    with pytest.raises(ValueError):
        RequestShape(prompt_tokens=0)
    with pytest.raises(ValueError):
        RequestShape(gen_tokens=-1)


def test_poisson_rate_and_gaps_within_statistical_tolerance():
    rate, duration = 40.0, 500.0
    t = poisson_arrivals(rate, np.random.default_rng(1), duration_s=duration)
    expected = rate * duration
    assert abs(len(t) - expected) < 4 * math.sqrt(expected)
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < duration
    gaps = np.diff(poisson_arrivals(rate, np.random.default_rng(2), n_requests=20000))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV = 1


def test_poisson_arguments():
    rng = np.random.default_rng(0)
    assert len(poisson_arrivals(5.0, rng, n_requests=7)) == 7
    for kwargs in ({}, {"duration_s": 1.0, "n_requests": 3}):
        with pytest.raises(ValueError, match="exactly one"):
            poisson_arrivals(5.0, rng, **kwargs)
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, rng, n_requests=3)


def test_users_homes_are_non_uniform_and_seeded():
    users = Users(2000, 10, zipf_s=1.0, seed=0)
    share = users.home_probs()
    assert share.sum() == pytest.approx(1.0) and users.server_probs.sum() == pytest.approx(1.0)
    assert share.max() > 0.25 and share.max() / max(share.min(), 1e-9) > 5
    chi2 = ((np.bincount(users.homes, minlength=10) - 200) ** 2 / 200).sum()
    assert chi2 > 100  # uniform would give ~9 (9 dof)
    assert np.array_equal(users.homes, Users(2000, 10, 1.0, seed=0).homes)
    hot = {int(np.argmax(Users(2000, 10, 1.0, seed=s).server_probs)) for s in range(6)}
    assert len(hot) > 1  # the hot server is a seeded choice, not always server 0
    flat = Users(20000, 10, zipf_s=0.0, seed=0).home_probs()
    assert flat.max() - flat.min() < 0.02
    with pytest.raises(ValueError):
        users.homes[0] = 1  # read-only


def test_generate_requests_is_deterministic_and_consistent():
    users = Users(50, 5, seed=3)
    shape = RequestShape(prompt_tokens=20, gen_tokens=4)
    reqs = generate_requests(40.0, shape, users, seed=9, duration_s=20.0)
    assert reqs == generate_requests(40.0, shape, users, seed=9, duration_s=20.0)
    assert reqs != generate_requests(40.0, shape, users, seed=10, duration_s=20.0)
    assert abs(len(reqs) - 800) < 4 * math.sqrt(800)
    assert [r.id for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert all(isinstance(r, Request) and r.home == users.homes[r.user] for r in reqs)
    assert all((r.prompt_tokens, r.gen_tokens, r.n_tokens) == (20, 4, 24) for r in reqs)
    assert max(r.id for r in reqs) < CALIBRATION_ID_BASE
    assert len(generate_requests(1.0, shape, users, seed=0, n_requests=5)) == 5


# --- calibration traffic -----------------------------------------------------
class _Recording:
    """A trace source that remembers which request ids it served."""

    def __init__(self, inner: SyntheticTrace) -> None:
        self.inner, self.ids = inner, []

    def route(self, request_id: int, n_tokens: int) -> Routing:
        self.ids.append(request_id)
        return self.inner.route(request_id, n_tokens)


def test_calibration_traffic_is_held_out_but_statistically_alike():
    users = Users(200, 6, seed=1)
    trace = _Recording(SyntheticTrace(MIXTRAL, seed=4))
    calib = calibration_traffic(trace, MIXTRAL, users.home_probs(), n_tokens=3000, seed=2)
    evaluation = generate_requests(40.0, RequestShape(), users, seed=2, n_requests=100)
    assert isinstance(calib, CalibrationTraffic)
    assert calib.targets.shape == (3000, MIXTRAL.n_layers, MIXTRAL.top_k)
    assert min(trace.ids) >= CALIBRATION_ID_BASE
    assert not set(trace.ids) & {r.id for r in evaluation}
    layers = calib.targets // MIXTRAL.experts_per_layer
    assert np.array_equal(layers, np.broadcast_to(np.arange(32)[None, :, None], layers.shape))
    homes = np.bincount(calib.homes, minlength=6) / 3000
    assert np.abs(homes - users.home_probs()).max() < 0.12  # 84 requests of 36 tokens share a home
    # Same per-layer popularity as evaluation traffic (same trace statistics).
    E = MIXTRAL.experts_per_layer
    eval_tokens = np.concatenate([trace.inner.route(r.id, 36).experts for r in evaluation])
    eval_pop = np.stack([np.bincount(eval_tokens[:, l].ravel(), minlength=E) for l in range(32)])
    eval_pop = eval_pop / eval_pop.sum(axis=1, keepdims=True)
    calib_pop = calib.popularity(MIXTRAL.shape().n_experts).reshape(32, E) / MIXTRAL.top_k
    assert np.abs(calib_pop - eval_pop).max() < 0.06
    assert np.corrcoef(calib_pop.ravel(), eval_pop.ravel())[0, 1] > 0.8


def test_calibration_traffic_is_deterministic_and_validated():
    trace = SyntheticTrace(SWITCH)
    a = calibration_traffic(trace, SWITCH, np.array([0.5, 0.5]), 100, seed=0, tokens_per_request=30)
    b = calibration_traffic(trace, SWITCH, np.array([0.5, 0.5]), 100, seed=0, tokens_per_request=30)
    assert np.array_equal(a.targets, b.targets) and np.array_equal(a.homes, b.homes)
    assert a.n_tokens == 100
    for bad in (np.array([0.5, 0.6]), np.array([-0.1, 1.1]), np.array([])):
        with pytest.raises(ValueError):
            calibration_traffic(trace, SWITCH, bad, 10, seed=0)
