"""Measured end-to-end quality: re-execute a proxy with recorded routing choices.

For every request of a run made on a proxy trace (``python -m workloads.proxy
trace``), the records give, per token, layer and gated target, the expert
that served it and that replica's precision. Replay runs the proxy on the
request's text segment twice, in the same batch shape: once exact at full
precision (the reference), once with exactly those choices (substitute
experts, quantized weights), routing teacher-forced to the recorded targets.

This module is the model side: the plans (``PlanSet``), their execution
(``replay_plans``), Lambda per token (``token_lambda``), the check that the
targets are the trace's, the reference cross-entropy and the summary. Reading
a run folder's records and writing ``quality_replay.csv`` and ``quality.json``
into it is ``testbed.quality_replay`` (``python -m testbed quality-replay RUN``).
Every choice exact at FP16 reproduces the reference bit for bit (zero KL):
both passes take the same code path on the same shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

from hetroute.quality import QualityModel

from ..quality_profile import profile_ce
from .data import Corpus
from .model import ExpertBank, Plan, ProxyMoE
from .profile import kl_rows


@dataclass(frozen=True)
class PlanSet:
    """Requests to replay: text segments (R, T+1) and their plans (R, T, L, k)."""

    seg: np.ndarray
    idx: np.ndarray
    exec: np.ndarray
    prec: np.ndarray


@torch.inference_mode()
def replay_plans(model: ProxyMoE, bank: ExpertBank, plans: PlanSet, batch: int = 128
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request and token: KL(ref || run) in nats, and the true-byte CE of ref and run."""
    kls, ce_ref, ce_run = [], [], []
    for s in range(0, len(plans.seg), batch):
        sl = slice(s, s + batch)
        tok = torch.from_numpy(plans.seg[sl, :-1].astype(np.int64))
        tgt = torch.from_numpy(plans.seg[sl, 1:].astype(np.int64))[..., None]
        idx = torch.from_numpy(plans.idx[sl].astype(np.int64))
        ref = model(tok, Plan.exact(idx), bank).logits
        run = model(tok, Plan(idx, torch.from_numpy(plans.exec[sl].astype(np.int64)),
                              torch.from_numpy(plans.prec[sl].astype(np.int64))), bank).logits
        ref_logp = torch.log_softmax(ref.double(), dim=-1)
        kls.append(kl_rows(ref_logp, run).numpy())
        ce_ref.append(-ref_logp.gather(-1, tgt)[..., 0].numpy())
        ce_run.append(-torch.log_softmax(run.double(), dim=-1).gather(-1, tgt)[..., 0].numpy())
    return np.concatenate(kls), np.concatenate(ce_ref), np.concatenate(ce_run)


def token_lambda(quality: QualityModel, idx: np.ndarray, exec_: np.ndarray, prec: np.ndarray,
                 experts_per_layer: int) -> np.ndarray:
    """Lambda of eq. (8) per request and token, from local ids (R, T, L, k)."""
    R, T, L, k = idx.shape
    off = (np.arange(L) * experts_per_layer)[None, None, :, None]
    tgt, ex = idx + off, exec_ + off
    inc = quality.q[ex, prec]
    sub = tgt != ex
    if sub.any():
        table = {(t, e): ls for t, grp in enumerate(quality.substitutes) for e, ls in grp}
        extra = np.array([table[(int(a), int(b))] for a, b in zip(tgt[sub], ex[sub])])
        inc = inc.copy()
        inc[sub] += extra
    return inc.sum(axis=(2, 3))


def check_routing(plans: PlanSet, trace_path: Path, model_name: str, request_ids: list[int]) -> None:
    """The recorded targets must be the trace's experts: else the run was not on this trace."""
    from ..models import get_model
    from ..traces import JsonlTrace

    tr = JsonlTrace(trace_path, get_model(model_name))
    for r, rid in enumerate(request_ids):
        T = plans.idx.shape[1]
        ex = tr.route(int(rid), T).experts
        if not np.array_equal(np.sort(ex, axis=-1), np.sort(plans.idx[r], axis=-1)):
            raise ValueError(f"request {rid}: recorded targets differ from {trace_path}; "
                             "was the run made on this trace?")


def summarise(df: pd.DataFrame, ce_ref: float) -> dict:
    """Measured quality over requests, and how well lam_mean ranks it (Spearman)."""
    out: dict = {"requests": int(len(df))}
    if df.empty:
        return out
    out |= {"degradation_mean": float(df.degradation.mean()),
            "degradation_p95": float(df.degradation.quantile(0.95)),
            "degradation_max": float(df.degradation.max()),
            "kl_nats_mean": float(df.kl_nats.mean()),
            "ppl_ref": float(np.exp(df.ce_ref.mean())), "ppl_run": float(np.exp(df.ce_run.mean())),
            "lam_mean": float(df.lam_mean.mean()), "lam_max": float(df.lam_max.max()),
            "quantized": int(df.quantized.sum()), "substituted": int(df.substituted.sum())}
    out["ppl_increase"] = out["ppl_run"] / out["ppl_ref"] - 1.0
    rho, p = _spearman(df.lam_mean.to_numpy(), df.degradation.to_numpy())
    out |= {"spearman_rho": rho, "spearman_p": p}
    return out


def _spearman(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan, math.nan
    res = spearmanr(x, y)
    return float(res.statistic), float(res.pvalue)


def reference_ce(profile: Path | None, model: ProxyMoE, corpus: Corpus) -> float:
    """The unit of q and Lambda: the profile's reference cross-entropy, else measured anew."""
    ce = profile_ce(profile)
    if ce is not None:
        return ce
    from .profile import calibration_ce
    return calibration_ce(model, corpus)
