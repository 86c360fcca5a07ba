"""Measured quality profile of a proxy: q per expert and precision, Q_sub per substitute.

Unit (what the 2% budget is a share of). Let CE_ref be the full-precision
proxy's mean next-byte cross-entropy (nats per token) on the calibration
segments. Perturbing expert E (quantizing it, or executing a substitute in its
place) for every calibration token gated to E changes the model's output
distribution at that token and, through attention, at later tokens of the
same segment. With KL_t = KL(p_ref,t || p_pert,t) at position t:

    q_{E,c} (or Q_sub(E, E^)) = sum_t KL_t / (n_exec(E) * CE_ref)

where n_exec(E) counts the calibration tokens gated to E. It is the expected
end-to-end loss increase caused by ONE execution of E at precision c (or by
E^), as a fraction of the model's own per-token loss: exactly the unit of an
increment of Lambda (eq. 8), so that a token's Lambda = sum of its increments
predicts its share of loss increase, and a budget of 0.02 allows 2% of the
per-token loss (for the real Mixtral on WikiText, 2% of ln 5.32 nats, a ~3.4%
perplexity increase). KL against the full-precision output, rather than the
change of the loss on the true next byte, is what the paper measures and is
never negative, so small effects are not lost in noise.

Substitutes: V_E is the ``group_size`` experts of E's layer whose outputs are
closest to E's on the calibration tokens gated to E (relative squared error
||E^(x) - E(x)||^2 / ||E(x)||^2); Q_sub(E, E^) is measured with E^ at full
precision, executed in E's slot with E's gate weight.

An expert no calibration token is gated to (possible with Qwen's 60 experts)
gets the median of its layer and is listed in the profile's ``imputed``.

Routing is teacher-forced (``model.Plan``) to the full-precision top-k in every
measurement, as in replay. Each measurement re-runs the model from the
perturbed layer on, batched over many perturbations (``max_tokens`` per batch).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from hetroute.quality import QualityModel
from hetroute.system import Precision

from ..models import get_model
from .data import Corpus, segments
from .model import ExpertBank, Plan, ProxyMoE, _ffn

SEGMENT = 36  # tokens per request (the testbed's default prompt length)


@dataclass(frozen=True)
class ProfileParams:
    """How much calibration text, how many substitutes, how large a batch."""

    calibration_segments: int = 32
    group_size: int = 2  # |V_E|, as hetroute.quality.prior_quality
    max_tokens: int = 24_000  # tokens per batched forward


def default_profile_params(model: str) -> ProfileParams:
    """Calibration size per model, traded against ``profile --all``'s 15-minute budget.

    Mean executions per expert: Mixtral 16 x 36 x 2/8 = 144; Switch 32 x 36 x
    1/8 = 144; Qwen only 16 x 36 x 4/60 = 38, as its 1440 experts make its
    profile the costliest by far (a few are never gated and get imputed).
    """
    name = get_model(model).name
    return ProfileParams(calibration_segments=32 if name == "switch-base-8" else 16)


def calibration_ce(model: ProxyMoE, corpus: Corpus, params: ProfileParams | None = None) -> float:
    """CE_ref, the unit of q, as ``measure`` computes it (for a replay without a profile)."""
    p = params or default_profile_params(model.cfg.model)
    return reference(model, model.bank(), segments(corpus.calibration, SEGMENT, p.calibration_segments)).ce


@dataclass
class Reference:
    """The full-precision pass over a set of segments that every measurement compares to."""

    tokens: torch.Tensor  # (S, T) inputs
    targets: torch.Tensor  # (S, T) next bytes
    plan: Plan  # exact, teacher-forced to the model's own routing
    logp: torch.Tensor  # (S, T, V) float64 log-probabilities
    weights: torch.Tensor  # (S, T, L, k) gate weights
    moe_in: list[torch.Tensor]
    moe_out: list[torch.Tensor]
    ce: float  # mean next-byte cross-entropy, nats

    @property
    def idx(self) -> torch.Tensor:
        return self.plan.idx


@torch.inference_mode()
def reference(model: ProxyMoE, bank: ExpertBank, seg: np.ndarray) -> Reference:
    """Route ``seg`` (S, T+1) with the model's own gate, then fix that routing."""
    tok = torch.from_numpy(seg[:, :-1].astype(np.int64))
    tgt = torch.from_numpy(seg[:, 1:].astype(np.int64))
    free = model(tok, bank=bank)
    plan = Plan.exact(free.idx)
    out = model(tok, plan, bank, keep=True)
    logp = torch.log_softmax(out.logits.double(), dim=-1)
    ce = float(-logp.gather(-1, tgt[..., None]).mean())
    return Reference(tok, tgt, plan, logp, out.weights, out.moe_in, out.moe_out, ce)


def kl_rows(ref_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) per position, float64, never below 0."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)


@dataclass
class _Variant:
    expert: int  # local id
    kind: int | tuple[str, int]  # a Precision, or ("sub", e_hat)
    seqs: torch.Tensor  # segments it changes
    h: torch.Tensor  # their residual stream after the layer


def _variants(model: ProxyMoE, bank: ExpertBank, ref: Reference, layer: int, e: int,
              subs: list[int]) -> Iterator[_Variant]:
    """INT8, INT4 and each substitute of expert ``e``, as perturbed residual streams."""
    blk = model.moe[layer]
    idx = ref.idx[:, :, layer]  # (S, T, k)
    hit = idx == e
    seqs = hit.any(-1).any(-1).nonzero().squeeze(1)
    if len(seqs) == 0:
        return
    s, t, j = hit.nonzero(as_tuple=True)
    x = ref.moe_in[layer][s, t]
    w = ref.weights[s, t, layer, j][:, None]
    wi, wo = bank.w_in[layer], bank.w_out[layer]
    y_ref = _ffn(x, wi[0, e], wo[0, e], blk.cfg.swiglu)
    pos = {int(q): n for n, q in enumerate(seqs)}
    rows = torch.tensor([pos[int(q)] for q in s], dtype=torch.long)
    kinds: list[int | tuple[str, int]] = [Precision.INT8, Precision.INT4, *(("sub", o) for o in subs)]
    for kind in kinds:
        if isinstance(kind, tuple):
            y = _ffn(x, wi[0, kind[1]], wo[0, kind[1]], blk.cfg.swiglu)
        else:
            y = _ffn(x, wi[kind, e], wo[kind, e], blk.cfg.swiglu)
        h = ref.moe_out[layer][seqs].clone()
        h.index_put_((rows, t), w * (y - y_ref), accumulate=True)
        yield _Variant(e, kind, seqs, h)


@torch.inference_mode()
def similarity_groups(model: ProxyMoE, bank: ExpertBank, ref: Reference, layer: int,
                      group_size: int) -> list[list[tuple[int, float]]]:
    """Per expert of ``layer``: the ``group_size`` closest others as (e_hat, relative error)."""
    E = model.cfg.experts
    idx = ref.idx[:, :, layer]
    x_all = ref.moe_in[layer].reshape(-1, model.cfg.d_model)
    wi, wo = bank.w_in[layer][0], bank.w_out[layer][0]
    outs_all = None
    groups = []
    for e in range(E):
        mask = (idx == e).any(-1).reshape(-1)
        if mask.any():
            x = x_all[mask]
            outs = torch.stack([_ffn(x, wi[o], wo[o], model.cfg.swiglu) for o in range(E)])
        else:  # never gated on calibration: compare on all of the layer's tokens
            if outs_all is None:
                outs_all = torch.stack([_ffn(x_all, wi[o], wo[o], model.cfg.swiglu) for o in range(E)])
            outs = outs_all
        err = ((outs - outs[e]) ** 2).sum((1, 2)) / (outs[e] ** 2).sum().clamp_min(1e-30)
        order = [o for o in torch.argsort(err, stable=True).tolist() if o != e][:group_size]
        groups.append([(o, float(err[o])) for o in order])
    return groups


@dataclass
class Measured:
    """A profile with what it was measured on (for the report)."""

    quality: QualityModel
    n_exec: np.ndarray  # calibration executions per expert
    similarity: list[list[tuple[int, float]]]  # per expert: (e_hat, relative output error)
    imputed: list[int]
    ce_ref: float
    profile_s: float


@torch.inference_mode()
def measure(model: ProxyMoE, corpus: Corpus, params: ProfileParams = ProfileParams(),
            log: Callable[[str], None] | None = None) -> Measured:
    """q and Q_sub of every expert (see the module docstring)."""
    t0 = time.perf_counter()
    cfg = model.cfg
    L, E = cfg.n_layers, cfg.experts
    bank = model.bank()
    ref = reference(model, bank, segments(corpus.calibration, SEGMENT, params.calibration_segments))
    S, T = ref.tokens.shape
    q = np.zeros((L * E, len(Precision)))
    subs: list[list[tuple[int, float]]] = [[] for _ in range(L * E)]
    similarity: list[list[tuple[int, float]]] = []
    n_exec = np.zeros(L * E, dtype=np.int64)
    for layer in range(L):
        groups = similarity_groups(model, bank, ref, layer, params.group_size)
        similarity.extend(groups)
        counts = torch.bincount(ref.idx[:, :, layer].reshape(-1), minlength=E).numpy()
        n_exec[layer * E:(layer + 1) * E] = counts
        kl: dict[tuple[int, object], float] = {}
        pending: list[_Variant] = []

        def flush() -> None:
            if not pending:
                return
            h = torch.cat([v.h for v in pending])
            seqs = torch.cat([v.seqs for v in pending])
            plan = Plan(*(t[seqs] for t in ref.plan))
            logits = model.tail(h, layer, plan, bank)
            per_seq = kl_rows(ref.logp[seqs], logits).sum(-1)
            start = 0
            for v in pending:
                kl[(v.expert, v.kind)] = float(per_seq[start:start + len(v.seqs)].sum())
                start += len(v.seqs)
            pending.clear()

        for e in range(E):
            for v in _variants(model, bank, ref, layer, e, [o for o, _ in groups[e]]):
                pending.append(v)
                if sum(len(p.seqs) for p in pending) * T >= params.max_tokens:
                    flush()
        flush()
        for e in range(E):
            g = layer * E + e
            n = counts[e]
            if n == 0:
                continue
            scale = 1.0 / (n * ref.ce)
            q[g, Precision.INT8] = kl[(e, Precision.INT8)] * scale
            q[g, Precision.INT4] = kl[(e, Precision.INT4)] * scale
            subs[g] = [(layer * E + o, max(kl[(e, ("sub", o))] * scale, 1e-12)) for o, _ in groups[e]]
        if log and (layer % 4 == 3 or layer == L - 1):
            log(f"{cfg.model}: profiled layer {layer + 1}/{L} ({time.perf_counter() - t0:.0f} s)")
    imputed = [int(g) for g in np.flatnonzero(n_exec == 0)]
    for g in imputed:
        layer, e = divmod(g, E)
        ok = [layer * E + o for o in range(E) if n_exec[layer * E + o] > 0]
        if not ok:
            raise RuntimeError(f"layer {layer}: no expert gated on calibration text")
        q[g, 1:] = np.median(q[ok, 1:], axis=0)
        sub_med = float(np.median([ls for o in ok for _, ls in subs[o]]))
        subs[g] = [(layer * E + o, sub_med) for o, _ in similarity[g]]
    quality = QualityModel(q=q, substitutes=tuple(tuple(sorted(s, key=lambda t: t[1])) for s in subs),
                           source=f"proxy:{cfg.model}")
    return Measured(quality, n_exec, similarity, imputed, ref.ce, time.perf_counter() - t0)


def summary(m: Measured) -> dict:
    """q per precision (mean, spread over experts) and the Q_sub distribution."""
    out: dict = {"ce_ref_nats": m.ce_ref, "experts": int(m.quality.q.shape[0]),
                 "imputed": len(m.imputed), "profile_s": round(m.profile_s, 1)}
    measured = np.ones(m.quality.q.shape[0], dtype=bool)
    measured[m.imputed] = False
    for c in Precision:
        v = m.quality.q[measured, c]
        out[f"q_{c.label}"] = _stats(v)
    sub = np.array([ls for g, grp in enumerate(m.quality.substitutes) if measured[g] for _, ls in grp])
    out["q_sub"] = _stats(sub)
    out["int4_over_int8_median"] = float(np.median(
        m.quality.q[measured, Precision.INT4] / np.maximum(m.quality.q[measured, Precision.INT8], 1e-30)))
    out["n_exec"] = _stats(m.n_exec.astype(float))
    return out


def _stats(v: np.ndarray) -> dict:
    if len(v) == 0:
        return {"n": 0}
    p = np.percentile(v, [5, 25, 50, 75, 95])
    return {"n": int(len(v)), "mean": float(v.mean()), "std": float(v.std()),
            "cv": float(v.std() / v.mean()) if v.mean() > 0 else math.nan,
            "min": float(v.min()), "p5": float(p[0]), "p25": float(p[1]), "median": float(p[2]),
            "p75": float(p[3]), "p95": float(p[4]), "max": float(v.max())}
