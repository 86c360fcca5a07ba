"""Per-token in-run execution of a proxy (what emulated workers do with quality.inrun).

The stepper is checked against the whole-request replay where the two must
agree: an exact plan gives zero loss; the first position, and a plan that
perturbs only the last position, give the replay's loss; splitting a
token's experts between servers (partial sums added in another order) does
not change the result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetroute.system import Precision
from workloads.proxy.data import segments
from workloads.proxy.inrun import ProxyStepper
from workloads.proxy.model import tiny_config
from workloads.proxy.replay import PlanSet, replay_plans
from workloads.proxy.trace import route_segments
from workloads.proxy.train import train

T = 12  # tokens per request in these tests


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module", params=["mixtral", "qwen", "switch"])
def proxy(request, corpus):
    model, _ = train(tiny_config(request.param, steps=2), corpus)
    seg = segments(corpus.heldout, 36, 3)[:, :T + 1]
    idx, _ = route_segments(model, seg)
    return model, seg, idx


def _step(st: ProxyStepper, rid: int, idx, exec_, prec, split: bool = False, fold: bool = False):
    """One request position by position, as the workers pass it around; per-token KL.
    ``fold``: as a pipeline stage hands a layer on (testbed/emu/node/compute.py), the
    residual and what the aggregator adds to it in the partial, the aggregator summing."""
    cfg = st.cfg
    kls = []
    for pos in range(idx.shape[0]):
        h = st.embed(rid, pos)
        for layer in range(cfg.n_layers):
            h = st.attend(rid, pos, layer, h)
            x = st.moe_input(layer, h)
            w = st.gate(layer, x, idx[pos, layer])
            parts = [torch.zeros_like(h), torch.zeros_like(h)]
            for j in range(cfg.top_k):
                y = st.expert(layer, int(exec_[pos, layer, j]), int(prec[pos, layer, j]), x[None])[0]
                parts[j % 2 if split else 0] += w[j] * y
            if fold:
                h = st.combine(layer, h, torch.zeros_like(h)) + parts[0]
            else:
                h = st.combine(layer, h, parts[1] + parts[0] if split else parts[0])
        kls.append(st.score(rid, pos, h)[0])
    return np.array(kls)


def test_exact_plan_has_zero_loss(proxy):
    model, seg, idx = proxy
    st = ProxyStepper(model, {0: seg[0]})
    kl = _step(st, 0, idx[0], idx[0], np.zeros_like(idx[0]))
    assert np.all(kl < 1e-9)
    _, ce_ref, ce_run = st.score(0, 3, _final_exact(st, 0, 3, idx[0]))
    assert ce_ref == pytest.approx(ce_run, abs=1e-6)


def _final_exact(st, rid, pos, idx):
    h = st.embed(rid, pos)
    for layer in range(st.cfg.n_layers):
        h = st.attend(rid, pos, layer, h)
        x = st.moe_input(layer, h)
        w = st.gate(layer, x, idx[pos, layer])
        y = sum(w[j] * st.expert(layer, int(idx[pos, layer, j]), 0, x[None])[0]
                for j in range(st.cfg.top_k))
        h = st.combine(layer, h, y)
    return h


def test_first_and_only_perturbed_last_position_match_the_replay(proxy):
    model, seg, idx = proxy
    st = ProxyStepper(model, {r: seg[r] for r in range(len(seg))})
    st.prepare()
    E = model.cfg.experts
    rng = np.random.default_rng(0)
    exec_ = idx.copy()
    prec = rng.choice([int(Precision.INT8), int(Precision.INT4)], size=idx.shape)
    exec_[:, :, :, 0] = (idx[:, :, :, 0] + 1) % E  # substitute the first slot everywhere
    full = PlanSet(seg, idx, exec_, prec)
    kl_replay, _, _ = replay_plans(model, model.bank(), full)
    last = PlanSet(seg, idx, idx.copy(), np.zeros_like(prec))
    last.exec[:, -1], last.prec[:, -1] = exec_[:, -1], prec[:, -1]
    kl_last, _, _ = replay_plans(model, model.bank(), last)
    for r in range(len(seg)):
        kl = _step(st, r, idx[r], exec_[r], prec[r])
        assert kl[0] == pytest.approx(kl_replay[r, 0], rel=1e-3, abs=1e-9)
        assert kl[0] > 0
        kl2 = _step(st, r, idx[r], last.exec[r], last.prec[r])
        assert np.all(kl2[:-1] < 1e-9)
        assert kl2[-1] == pytest.approx(kl_last[r, -1], rel=1e-3, abs=1e-9)
        assert kl2[-1] > 0


@pytest.mark.parametrize("way", ["split", "fold"])
def test_a_token_summed_another_way_is_the_same(proxy, way):
    """``split``: partial sums from two servers. ``fold``: the emulator's folded hand-off,
    which relies on the aggregator's combine being the residual (and Qwen's shared expert
    of it) plus the routed sum, linear in the routed part."""
    model, seg, idx = proxy
    if way == "split" and model.cfg.top_k < 2:
        pytest.skip("one expert per token cannot be split")  # Switch: top-1
    st = ProxyStepper(model, {0: seg[0]})
    prec = np.full_like(idx[0], int(Precision.INT4))
    one = _step(st, 0, idx[0], idx[0], prec)
    other = _step(st, 0, idx[0], idx[0], prec, **{way: True})
    assert np.allclose(one, other, rtol=1e-4, atol=1e-10)
    assert np.all(one > 0)


def test_text_longer_than_the_context_is_refused(corpus):
    model, _ = train(tiny_config("mixtral", steps=1), corpus)
    long = np.zeros(model.cfg.context + 2, dtype=np.int64)
    with pytest.raises(ValueError, match="exceeds the proxy's context"):
        ProxyStepper(model, {0: long}).prepare()


def test_inrun_spec_errors_name_the_field(tmp_path):
    from testbed.setup import resolve_inputs
    from testbed.spec import SpecError, parse_spec

    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    (tmp_path / "t.meta.json").write_text('{"model": "mixtral-8x7b", "proxy_key": "k"}')
    base = {"backend": "emu", "quality": {"inrun": True},
            "workload": {"trace": str(trace), "gen_tokens": 0}}
    resolve_inputs(parse_spec(base))  # a proxy trace and 36 tokens: accepted
    for over, msg in (({"backend": "sim"}, "only emulated workers"),
                      ({"workload": {"trace": "synthetic"}}, "needs workload.trace 'proxy'"),
                      ({"workload": {"trace": str(trace), "gen_tokens": 4}}, "at most 36 tokens")):
        with pytest.raises(SpecError, match=msg):
            resolve_inputs(parse_spec({**base, **over}))


def test_inrun_raises_the_dilation_floor():
    from types import SimpleNamespace

    from testbed.emu.dilation import INRUN_MIN_DILATION, MIN_DILATION, choose_dilation
    from testbed.spec import parse_spec
    from workloads.models import get_model

    for inrun, floor in ((False, MIN_DILATION), (True, INRUN_MIN_DILATION)):
        spec = parse_spec({"backend": "emu", "quality": {"inrun": inrun},
                           "workload": {"rate_per_s": 1, "gen_tokens": 0}})
        T, why = choose_dilation(SimpleNamespace(spec=spec, shape=get_model("mixtral").shape()))
        assert T == floor and "floor" in why
    busy = parse_spec({"backend": "emu", "quality": {"inrun": True},
                       "workload": {"rate_per_s": 200, "gen_tokens": 0}})  # in-run: prompt only
    plain = busy.with_overrides({"quality.inrun": False})
    shape = get_model("mixtral").shape()
    assert choose_dilation(SimpleNamespace(spec=busy, shape=shape))[0] > \
        choose_dilation(SimpleNamespace(spec=plain, shape=shape))[0]


def test_reference_follows_the_given_routes(proxy):
    """The run follows the trace's targets; the reference must use the same experts."""
    model, seg, idx = proxy
    forced = (idx[0] + 1) % model.cfg.experts  # not the proxy's own choice
    exact = np.zeros_like(forced)
    own = _step(ProxyStepper(model, {0: seg[0]}), 0, forced, forced, exact)
    given = _step(ProxyStepper(model, {0: seg[0]}, routes=lambda rid: forced), 0, forced, forced, exact)
    assert np.all(given < 1e-9) and own.max() > 1e-6


def test_collect_counts_a_request_once_and_tolerates_none(tmp_path):
    import json

    from testbed.records import RecordWriter, TokenLayerRecord
    from testbed.quality_inrun import INRUN_DIR, collect

    assert collect(tmp_path, 1.0, 0.0)[1] == {"requests": 0}  # e.g. every request failed
    w = RecordWriter(tmp_path, 2)
    for layer in range(2):
        w.token_layer(TokenLayerRecord(0, 0, layer, 0.0, 0, 0, 1, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 0.0,
                                       0.0, 0.0, 0.0, 0.0, [1, 2], [1, 3], [0, 1], [0, 0], [0, 2],
                                       [True, True], [0, 0]))
    w.close()
    line = json.dumps({"request": 0, "arrival_s": 1.0, "tokens": 1, "lam_mean": 0.1, "lam_max": 0.1,
                       "kl_tokens": [0.2], "ce_ref_tokens": [2.0], "ce_run_tokens": [2.1]})
    (tmp_path / INRUN_DIR).mkdir()
    (tmp_path / INRUN_DIR / "w0.jsonl").write_text(line + "\n" + line + "\n")
    df, summary = collect(tmp_path, 2.0, 0.5)
    assert len(df) == 1 and summary["requests"] == 1
    assert df.degradation[0] == pytest.approx(0.1) and df.quantized[0] == 2 and df.substituted[0] == 2
