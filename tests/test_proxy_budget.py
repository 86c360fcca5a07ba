"""Budget accounting under a measured profile, for every router that honours the budget.

A tiny Mixtral-shaped proxy is profiled, its routing exported as a trace, and
each registered router (discovered, so new baselines are covered) runs a short
simulation on small3, where Mixtral does not fit in GPU memory at FP16 and
quantized replicas compete for the budget. Per token, Lambda recomputed from
the recorded (target, executed expert, precision) under the profile must equal
the router's own accounting (sum of dq) and stay within Lambda_max; replaying
the records gives zero KL exactly for all-exact requests and a positive one
for the others.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hetroute.routers import available, get_router
from hetroute.system import Precision
from testbed.quality_replay import run_replay
from testbed.records import flat, read_records
from testbed.runner import run_experiment
from testbed.spec import parse_spec
from workloads.models import get_model
from workloads.proxy.data import load_corpus
from workloads.proxy.model import tiny_config
from workloads.proxy.profile import ProfileParams, measure
from workloads.proxy.trace import export_trace
from workloads.proxy.train import train
from workloads.quality_profile import load_profile, save_profile

#: A router is skipped only if its documentation says it ignores the quality budget.
IGNORES_BUDGET = re.compile(r"(ignor\w*|does not (use|honou?r|enforce|respect)|without)[^.]*"
                            r"quality budget|budget[^.]*(not (used|enforced|honou?red)|ignored)",
                            re.IGNORECASE)
MIXTRAL = get_model("mixtral")


def honours_budget(name: str) -> bool:
    import sys

    cls = get_router(name)
    docs = " ".join(filter(None, [cls.__doc__, sys.modules[cls.__module__].__doc__,
                                  cls.Params.__doc__]))
    return not IGNORES_BUDGET.search(docs)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    corpus = load_corpus()
    model, _ = train(tiny_config("mixtral", steps=2), corpus)
    m = measure(model, corpus, ProfileParams(calibration_segments=2))
    root = tmp_path_factory.mktemp("proxy")
    save_profile(root / "profile.npz", m.quality, {"model": MIXTRAL.name, "source": "proxy:test",
                                                   "ce_ref_nats": m.ce_ref})
    export_trace(model, corpus, root / "trace.jsonl", requests=12, calibration_requests=2)
    # Budget: half of what a token needs to run every expert at INT4, so it binds.
    budget = 0.5 * MIXTRAL.n_layers * MIXTRAL.top_k * float(m.quality.q[:, Precision.INT4].mean())
    yield model, corpus, m, root, budget
    torch.set_num_threads(before)


@pytest.mark.parametrize("router", [pytest.param(r, marks=() if r == "hetroute" else pytest.mark.slow)
                                    for r in available()])  # test-fast: HetRoute only
def test_budget_accounting_never_exceeds_lambda_max(router, proxy, tmp_path):
    if not honours_budget(router):
        pytest.skip(f"{router} documents that it does not use the quality budget")
    model, corpus, m, root, budget = proxy
    spec = parse_spec({
        "name": f"budget-{router}", "topology": "small3", "router": {"name": router},
        "workload": {"model": "mixtral", "trace": str(root / "trace.jsonl"), "duration_s": 0.3,
                     "warmup_s": 0.05, "rate_per_s": 20, "calibration_tokens": 72, "users": 20,
                     "gen_tokens": 0},  # prompt only: replay scores one 36-token segment
        "quality": {"budget": budget, "profile": str(root / "profile.npz"), "replay": False}})
    run_experiment(spec, tmp_path, progress=False)
    tl, rq = read_records(tmp_path)
    assert len(rq) > 0 and (rq.status == "ok").all()
    quality = load_profile(root / "profile.npz", MIXTRAL.shape())
    target, executed, prec = (flat(tl[c]) for c in ("target", "exec_expert", "precision"))
    inc = np.array([sum(quality.increment(int(t), int(e), int(c)) for t, e, c in zip(*row))
                    for row in zip(target, executed, prec)])
    np.testing.assert_allclose(inc, tl.dq.to_numpy(), rtol=1e-9, atol=1e-15)
    per_token = tl.assign(inc=inc).groupby(["request", "token"]).inc.sum()
    assert per_token.max() <= budget * (1 + 1e-9)
    assert (rq.lam_max <= budget * (1 + 1e-9)).all()
    if router == "hetroute":  # the budget binds: the check is not vacuous
        assert per_token.max() > 0.5 * budget

    df, summary = run_replay(tmp_path, model, corpus, root / "trace.jsonl", quality, m.ce_ref)
    exact = (df.quantized == 0) & (df.substituted == 0)
    assert (df.kl_nats[exact] == 0).all() and (df.kl_nats[~exact] > 0).all()
    np.testing.assert_allclose(df.lam_recomputed, df.lam_mean, rtol=1e-9, atol=1e-15)
    assert summary["requests"] == int(df.measured.sum())
