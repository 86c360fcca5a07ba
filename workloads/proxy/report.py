"""The profile report: q and Q_sub statistics and a router-independent surrogate check.

The check asks whether Lambda (eq. 8, the sum of profiled increments) ranks
requests by their measured end-to-end degradation when many choices act at
once. On held-out segments it draws execution plans of two families and
replays them (``replay.replay_plans``):

- ``free``: every gated slot is, independently, substituted (by a member of
  its similarity group, at a random precision) with probability 0.15 a,
  else quantized (INT4 2/3, INT8 1/3) with probability a, else exact FP16;
  the intensity a is uniform in [0, 1] per request.
- ``budgeted``: the same proposals at a = 1, accepted layer by layer only while
  the token's Lambda stays within a per-request budget drawn in [0.2%, 3%]
  (what a budget-honouring router does), else exact FP16.

Spearman's rho of a request's lam_mean against its measured degradation is
reported for both families together and apart. The same check on a real run
is ``replay`` + ``analysis/quality/surrogate.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from hetroute.quality import QualityModel
from hetroute.system import Precision

from .data import Corpus, segments
from .model import ProxyMoE
from .profile import SEGMENT, Measured, summary
from .replay import PlanSet, _spearman, replay_plans, token_lambda
from .trace import route_segments

_CHECK_TAG = 0x5C4E


def _propose(rng: np.random.Generator, a: float, group: tuple[tuple[int, float], ...],
             target: int, E: int) -> tuple[int, int]:
    """(executed local expert, precision) for one slot at intensity ``a``."""
    u = rng.random()
    if u < 0.15 * a and group:
        e_hat = group[int(rng.integers(len(group)))][0] % E
        return e_hat, int(rng.choice(3, p=[0.5, 0.25, 0.25]))
    if u < a:
        return target, int(Precision.INT4 if rng.random() < 2 / 3 else Precision.INT8)
    return target, int(Precision.FP16)


def synthetic_plans(idx: np.ndarray, quality: QualityModel, E: int, seed: int
                    ) -> tuple[np.ndarray, np.ndarray, list[str], np.ndarray]:
    """Plans for the gated experts ``idx`` (R, T, L, k): (exec, prec, family, knob)."""
    rng = np.random.default_rng([seed, _CHECK_TAG])
    R, T, L, k = idx.shape
    exec_, prec = idx.copy(), np.zeros_like(idx)
    family, knob = [], np.zeros(R)
    for r in range(R):
        budgeted = r % 2 == 1
        family.append("budgeted" if budgeted else "free")
        knob[r] = rng.uniform(0.002, 0.03) if budgeted else rng.uniform(0.0, 1.0)
        a = 1.0 if budgeted else knob[r]
        for t in range(T):
            lam = 0.0
            for layer in range(L):
                for j in range(k):
                    tgt = int(idx[r, t, layer, j])
                    g = layer * E + tgt
                    e_hat, c = _propose(rng, a, quality.substitutes[g], tgt, E)
                    inc = quality.increment(g, layer * E + e_hat, c)
                    if budgeted and lam + inc > knob[r]:
                        continue  # exact FP16: zero increment
                    lam += inc
                    exec_[r, t, layer, j], prec[r, t, layer, j] = e_hat, c
    return exec_, prec, family, knob


def surrogate_check(model: ProxyMoE, corpus: Corpus, quality: QualityModel, ce_ref: float,
                    requests: int = 96, seed: int = 0) -> tuple[pd.DataFrame, dict]:
    """Replay random plans on held-out text; per-request table and correlations."""
    seg = segments(corpus.heldout, SEGMENT, requests)
    idx, _ = route_segments(model, seg)
    E = model.cfg.experts
    exec_, prec, family, knob = synthetic_plans(idx, quality, E, seed)
    kl, ce0, ce1 = replay_plans(model, model.bank(), PlanSet(seg, idx, exec_, prec))
    lam = token_lambda(quality, idx, exec_, prec, E)
    df = pd.DataFrame({"request": np.arange(requests), "family": family, "knob": knob,
                       "lam_mean": lam.mean(1), "lam_max": lam.max(1),
                       "degradation": kl.mean(1) / ce_ref, "kl_nats": kl.mean(1),
                       "ppl_ratio": np.exp(ce1.mean(1) - ce0.mean(1)),
                       "substituted": (exec_ != idx).sum((1, 2, 3)),
                       "quantized": (prec != 0).sum((1, 2, 3))})
    out: dict = {"requests": requests}
    for name, part in [("all", df), *df.groupby("family")]:
        rho, p = _spearman(part.lam_mean.to_numpy(), part.degradation.to_numpy())
        pos = part[part.lam_mean > 0]
        out[name] = {"spearman_rho": rho, "spearman_p": p, "n": int(len(part)),
                     "median_measured_over_lambda": float(np.median(pos.degradation / pos.lam_mean))
                     if len(pos) else math.nan,
                     "lam_mean_range": [float(part.lam_mean.min()), float(part.lam_mean.max())]}
    return df, out


def _fmt(x: float) -> str:
    return f"{x:.3g}" if isinstance(x, float) and math.isfinite(x) else str(x)


def write_report(out_dir: Path, m: Measured, train_info: dict, check: dict, meta: dict) -> dict:
    """``report.json`` and ``report.md`` next to the profile."""
    s = summary(m)
    data = {"model": meta["model"], "profile": s, "surrogate_check": check, "train": {
        k: train_info.get(k) for k in ("train_s", "train_loss_first", "train_loss_final",
                                       "heldout_loss", "tokens_seen", "params", "cached")},
        "meta": {k: v for k, v in meta.items() if k not in ("n_exec", "imputed")}}
    (out_dir / "report.json").write_text(json.dumps(data, indent=1, default=str))
    rows = []
    for key, label in (("q_int8", "q INT8"), ("q_int4", "q INT4"), ("q_sub", "Q_sub")):
        st = s[key]
        rows.append(f"| {label} | {st['n']} | {_fmt(st['mean'])} | {_fmt(st['std'])} | "
                    f"{_fmt(st['p5'])} | {_fmt(st['median'])} | {_fmt(st['p95'])} | {_fmt(st['max'])} |")
    chk = [f"| {name} | {check[name]['n']} | {_fmt(check[name]['spearman_rho'])} | "
           f"{_fmt(check[name]['spearman_p'])} | {_fmt(check[name]['median_measured_over_lambda'])} |"
           for name in ("all", "free", "budgeted") if name in check]
    cfg = meta["proxy"]
    md = f"""# Quality profile: {meta['model']} (proxy)

Proxy: {cfg['n_layers']} MoE layers x {cfg['experts']} experts, top-{cfg['top_k']}, d_model {cfg['d_model']},
expert d_ff {cfg['expert_d_ff']} ({'SwiGLU' if cfg['swiglu'] else 'ReLU'}), shared expert d_ff {cfg['shared_d_ff']},
dense blocks d_ff {cfg['dense_d_ff']}; {train_info.get('params')} parameters. Text: {meta['text']}.
Training: {train_info.get('train_s')} s, loss {_fmt(train_info.get('train_loss_first'))} -> {_fmt(train_info.get('train_loss_final'))}
nats/byte (held-out {_fmt(train_info.get('heldout_loss'))}).

Unit: {meta['unit']}
CE_ref = {_fmt(m.ce_ref)} nats on {meta['calibration_segments']} calibration segments of {meta['segment_tokens']}
tokens; executions per expert: median {_fmt(s['n_exec']['median'])}, min {_fmt(s['n_exec']['min'])};
{len(m.imputed)} experts imputed (never gated on calibration text). Profiling took {_fmt(m.profile_s)} s.

| quantity | n | mean | std | p5 | median | p95 | max |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

q FP16 is 0 by definition. Median INT4/INT8 ratio over experts: {_fmt(s['int4_over_int8_median'])}.

## Surrogate check (random plans on held-out text; see workloads/proxy/report.py)

| plans | requests | Spearman rho | p-value | median measured / Lambda |
|---|---|---|---|---|
{chr(10).join(chk)}

![surrogate](surrogate.png)
"""
    (out_dir / "report.md").write_text(md)
    return data
