"""Proxy models: deterministic training, quantization, the measured profile, traces and replay.

Everything runs on seconds-to-train ``tiny_config`` proxies with the real
routing shapes; full-size training only happens in ``python -m workloads.proxy``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hetroute.system import Precision
from workloads.models import get_model
from workloads.proxy.data import load_corpus, segments
from workloads.proxy.model import Plan, proxy_config, tiny_config
from workloads.proxy.profile import ProfileParams, measure, summary
from workloads.proxy.quant import int4_group, quantize
from workloads.proxy.replay import PlanSet, replay_plans, token_lambda
from workloads.proxy.report import surrogate_check, synthetic_plans
from workloads.proxy.trace import export_trace, file_request, route_segments
from workloads.proxy.train import cache_path, load_or_train, train
from workloads.quality_profile import ProfileError, load_profile, save_profile
from workloads.traces import CALIBRATION_ID_BASE, JsonlTrace

TINY_PROFILE = ProfileParams(calibration_segments=3)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def switch(corpus):
    model, _ = train(tiny_config("switch"), corpus)
    return model


@pytest.fixture(scope="module")
def switch_profile(switch, corpus):
    return measure(switch, corpus, TINY_PROFILE)


def test_corpus_splits_are_disjoint_and_deterministic(corpus):
    again = load_corpus()
    assert again == corpus
    sizes = [len(corpus.train), len(corpus.calibration), len(corpus.heldout)]
    assert min(sizes) > 10_000 and corpus.train not in (corpus.calibration, corpus.heldout)
    # split by topic and de-duplicated: held-out prose does not recur in training text
    # (table rules such as "----+----" do, hence windows with mostly letters only)
    for text in (corpus.heldout, corpus.calibration):
        windows = [w for w in (text[i:i + 48] for i in range(0, 48 * 400, 48))
                   if sum(chr(b).isalpha() for b in w) >= 30]
        assert len(windows) > 100 and sum(w in corpus.train for w in windows) / len(windows) < 0.02
    seg = segments(corpus.heldout, 36, 3)
    assert seg.shape == (3, 37) and bytes(seg[1, :36]) == corpus.heldout[36:72]
    assert seg[0, 36] == seg[1, 0]  # the last target is the next segment's first byte


@pytest.mark.slow
def test_training_is_deterministic(corpus):
    cfg = tiny_config("mixtral", steps=2)
    a, _ = train(cfg, corpus)
    b, _ = train(cfg, corpus)
    c, _ = train(tiny_config("mixtral", steps=2, seed=1), corpus)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_cache_reuses_weights_and_config_change_retrains(corpus, tmp_path):
    cfg = tiny_config("switch", steps=1)
    a, info = load_or_train(cfg, corpus, tmp_path)
    b, info_b = load_or_train(cfg, corpus, tmp_path)
    assert info["cached"] == info_b["cached"] and len(list(tmp_path.glob("*.pt"))) == 1
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert cache_path(cfg, corpus, tmp_path) != cache_path(tiny_config("switch", steps=2), corpus, tmp_path)


def test_proxies_have_the_real_routing_shape():
    for name in ("mixtral", "qwen", "switch"):
        spec, cfg = get_model(name), proxy_config(name)
        assert (cfg.n_layers, cfg.experts, cfg.top_k) == (spec.n_layers, spec.experts_per_layer, spec.top_k)
        assert bool(cfg.shared_d_ff) == bool(spec.shared_expert_d_ff)


def test_quantization_error_ordering_and_groups():
    w = torch.randn(3, 32, 256, generator=torch.Generator().manual_seed(0))
    assert torch.equal(quantize(w, Precision.FP16), w)
    err8 = (quantize(w, Precision.INT8) - w).norm()
    err4 = (quantize(w, Precision.INT4) - w).norm()
    assert 0 < err8 < err4
    q4 = quantize(w, Precision.INT4)
    assert int4_group(256) == 128 and int4_group(64) == 64
    for g in range(2):  # each group of 128 inputs has its own scale: at most 15 levels
        block = q4[..., g * 128:(g + 1) * 128]
        scale = block.abs().amax(-1, keepdim=True) / 7
        assert torch.allclose(block / scale, torch.round(block / scale), atol=1e-4)
    q8 = quantize(w, Precision.INT8)
    assert torch.allclose(q8, w, atol=float(w.abs().max()) / 127)


def test_exact_plan_equals_free_routing(switch, corpus):
    seg = torch.from_numpy(segments(corpus.heldout, 36, 4)[:, :-1].astype(np.int64))
    free = switch(seg)
    forced = switch(seg, Plan.exact(free.idx), switch.bank())
    assert torch.equal(free.logits, forced.logits)


def test_profile_structure_and_real_shape(switch_profile, tmp_path):
    m = switch_profile
    q = m.quality.q
    shape = get_model("switch").shape()
    assert q.shape == (shape.n_experts, 3)
    assert np.all(q[:, Precision.FP16] == 0) and np.all(q >= 0)
    assert q[:, Precision.INT4].mean() >= q[:, Precision.INT8].mean() > 0
    for e, group in enumerate(m.quality.substitutes):
        assert len(group) == 2
        assert all(shape.layer_of(o) == shape.layer_of(e) and o != e and ls > 0 for o, ls in group)
        assert [ls for _, ls in group] == sorted(ls for _, ls in group)
    path = tmp_path / "p.npz"
    save_profile(path, m.quality, {"model": "switch-base-8", "source": "proxy:test", "ce_ref_nats": m.ce_ref})
    loaded = load_profile(path, shape)
    assert np.array_equal(loaded.q, q) and loaded.substitutes == m.quality.substitutes
    s = summary(m)
    assert s["q_int4"]["mean"] >= s["q_int8"]["mean"] and s["q_sub"]["n"] > 0


@pytest.mark.slow
def test_profile_of_qwen_shape_loads(corpus, tmp_path):
    """Shared expert and 60 experts per layer; unseen experts are imputed, not left at zero."""
    model, _ = train(tiny_config("qwen", steps=1), corpus)
    m = measure(model, corpus, ProfileParams(calibration_segments=1))
    assert np.all(m.quality.q[:, Precision.INT4] > 0)
    save_profile(tmp_path / "q.npz", m.quality, {"source": "t"})
    assert load_profile(tmp_path / "q.npz", get_model("qwen").shape()).q.shape == (24 * 60, 3)


def test_profile_errors_are_plain_and_the_spec_names_the_field(tmp_path):
    """The file format raises ProfileError (a ValueError); the spec layer adds the field."""
    from testbed.setup import build_setup
    from testbed.spec import SpecError, parse_spec

    shape = get_model("switch").shape()
    with pytest.raises(ProfileError, match="no such file"):
        load_profile(tmp_path / "none.npz", shape)
    bad = tmp_path / "bad.npz"
    bad.write_text("not a profile")
    with pytest.raises(ProfileError, match="bad.npz is not a quality profile") as exc:
        load_profile(bad, shape)
    assert not isinstance(exc.value, SpecError)
    with pytest.raises(SpecError, match=r"^quality.profile: \S*bad.npz is not a quality profile"):
        build_setup(parse_spec({"workload": {"model": "switch"}, "quality": {"profile": str(bad)}}))


def _plans(model, corpus, n=4):
    seg = segments(corpus.heldout, 36, n)
    idx, _ = route_segments(model, seg)
    return seg, idx


def test_replay_exact_is_zero_and_perturbed_is_positive(switch, switch_profile, corpus):
    seg, idx = _plans(switch, corpus)
    bank = switch.bank()
    kl, ce0, ce1 = replay_plans(switch, bank, PlanSet(seg, idx, idx.copy(), np.zeros_like(idx)))
    assert np.all(kl == 0.0) and np.array_equal(ce0, ce1)
    int4 = np.full_like(idx, int(Precision.INT4))
    kl4, _, _ = replay_plans(switch, bank, PlanSet(seg, idx, idx.copy(), int4))
    assert np.all(kl4.sum(1) > 0)
    E = switch.cfg.experts
    sub = np.array([[[[switch_profile.quality.substitutes[layer * E + e][0][0] - layer * E for e in row]
                      for layer, row in enumerate(tok)] for tok in req] for req in idx])
    kls, _, _ = replay_plans(switch, bank, PlanSet(seg, idx, sub, np.zeros_like(idx)))
    assert kls.mean() > kl4.mean() > 0  # substituting every expert is worse than INT4 everywhere
    lam = token_lambda(switch_profile.quality, idx, sub, np.zeros_like(idx), E)
    assert np.all(lam > 0)


def test_surrogate_check_runs_and_budgeted_plans_respect_budget(switch, switch_profile, corpus):
    _, idx = _plans(switch, corpus, 6)
    q = switch_profile.quality
    exec_, prec, family, knob = synthetic_plans(idx, q, switch.cfg.experts, seed=0)
    lam = token_lambda(q, idx, exec_, prec, switch.cfg.experts)
    for r, fam in enumerate(family):
        if fam == "budgeted":
            assert lam[r].max() <= knob[r] * (1 + 1e-9)
    df, stats = surrogate_check(switch, corpus, q, switch_profile.ce_ref, requests=8)
    assert len(df) == 8 and set(stats) >= {"all", "free", "budgeted"}
    assert (df.degradation >= 0).all() and df.lam_mean.max() > 0


def test_trace_round_trips_and_maps_requests_like_the_reader(switch, corpus, tmp_path):
    path = tmp_path / "t.jsonl"
    meta = export_trace(switch, corpus, path, requests=3, calibration_requests=2)
    assert json.loads((tmp_path / "t.meta.json").read_text()) == meta
    tr = JsonlTrace(path, get_model("switch"))
    seg, idx = _plans(switch, corpus, 3)
    for r in range(3):
        assert np.array_equal(np.sort(tr.route(r, 36).experts, -1), np.sort(idx[r], -1))
    cal = segments(corpus.calibration, 36, 2)
    cal_idx, _ = route_segments(switch, cal)
    for rid in (5, 7, CALIBRATION_ID_BASE + 1, CALIBRATION_ID_BASE + 9):
        split, i = file_request(rid, meta)
        want = idx[i] if split == "heldout" else cal_idx[i]
        assert np.array_equal(np.sort(tr.route(rid, 36).experts, -1), np.sort(want, -1))
    assert file_request(CALIBRATION_ID_BASE + 1, meta) == ("calibration", 1)


def test_surrogate_plot_from_a_profile_folder(tmp_path):
    from analysis.quality.surrogate import main as surrogate_main

    rng = np.random.default_rng(0)
    lam = rng.uniform(1e-4, 1e-2, 40)
    pd_rows = "request,family,lam_mean,degradation\n" + "\n".join(
        f"{i},{'free' if i % 2 else 'budgeted'},{x},{x * rng.uniform(0.5, 2)}" for i, x in enumerate(lam))
    (tmp_path / "surrogate.csv").write_text(pd_rows)
    assert surrogate_main([str(tmp_path), "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").stat().st_size > 0
    assert surrogate_main([str(tmp_path / "missing")]) == 2


def test_cli_input_errors_exit_2(tmp_path, capsys):
    from workloads.proxy.__main__ import main as proxy_main

    with pytest.raises(SystemExit) as exc:
        proxy_main(["profile"])  # neither --model nor --all
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        proxy_main(["train", "--model", "gpt"])
    assert exc.value.code == 2
    assert proxy_main(["replay", str(tmp_path / "nothing")]) == 2  # moved: one line points there
    assert "python -m testbed quality-replay" in capsys.readouterr().err


def test_quality_replay_cli_input_errors_exit_2(tmp_path):
    from typer.testing import CliRunner

    from testbed.cli import app

    out = CliRunner().invoke(app, ["quality-replay", str(tmp_path / "nothing")])
    assert out.exit_code == 2 and "not a run folder" in out.output
