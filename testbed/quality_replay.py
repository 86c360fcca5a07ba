"""Measured end-to-end quality of a finished run: re-execute what its records say.

For every request of a run made on a proxy trace (``python -m workloads.proxy
trace``), the records give, per token, layer and gated target, the expert
that served it and that replica's precision. Replay runs the proxy on the
request's text segment twice, in the same batch shape: once exact at full
precision (the reference), once with exactly those choices (substitute
experts, quantized weights), routing teacher-forced to the recorded targets
(the model side is ``workloads.proxy.replay``; this module reads the run
folder and writes the results into it).

Per request (``<run>/quality_replay.csv``):

- ``degradation``: mean over its tokens of KL(p_ref || p_run) / CE_ref, the
  unit of q and Lambda (see ``workloads.proxy.profile``), so it is comparable
  with the request's ``lam_mean`` (Lambda per token, averaged over its tokens);
- ``kl_nats``: the same KL in nats per token;
- ``ce_ref``, ``ce_run``: next-byte cross-entropy on the true text, and
  ``ppl_ratio`` = exp(ce_run - ce_ref) (perplexity change of that request);
- ``lam_mean``/``lam_max`` from the records and ``lam_recomputed`` (per-token
  Lambda summed from the per-target increments under the run's profile).

``<run>/quality.json`` summarises the measured requests (arrival after
warm-up, as ``metrics.json``) and the Spearman correlation of lam_mean with
the measured degradation. Every choice exact at FP16 reproduces the reference
bit for bit (zero KL): both passes take the same code path on the same shapes.

Command line: ``python -m testbed quality-replay RUN``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from hetroute.quality import QualityModel
from hetroute.system import Precision
from workloads.models import get_model
from workloads.proxy.data import Corpus, load_corpus, segments
from workloads.proxy.model import ProxyMoE, proxy_config
from workloads.proxy.profile import SEGMENT
from workloads.proxy.replay import (PlanSet, check_routing, reference_ce, replay_plans, summarise,
                                    token_lambda)
from workloads.proxy.trace import file_request, meta_path, trace_proxy
from workloads.proxy.train import load_or_train
from workloads.quality_profile import load_profile

from .records import flat, read_records


def plans_from_records(tl: pd.DataFrame, request_ids: list[int], corpus: Corpus, meta: dict,
                       n_layers: int, experts: int) -> tuple[PlanSet, list[tuple[str, int]]]:
    """Each request's segment and recorded choices, as local expert ids."""
    tl = tl[tl.request.isin(request_ids)].sort_values(["request", "token", "layer"], kind="stable")
    k = len(tl.target.iloc[0])
    target, exec_, prec = (flat(tl[c]).astype(np.int64) for c in ("target", "exec_expert", "precision"))
    layer = tl.layer.to_numpy().astype(np.int64)[:, None]
    target, exec_ = target - layer * experts, exec_ - layer * experts
    if target.min() < 0 or target.max() >= experts or exec_.min() < 0 or exec_.max() >= experts:
        raise ValueError("an executed expert is outside its target's layer")
    counts = tl.groupby("request", sort=True).size()
    where = [file_request(int(r), meta) for r in counts.index]
    held = segments(corpus.heldout, SEGMENT, meta["heldout_requests"])
    cal = segments(corpus.calibration, SEGMENT, meta["calibration_requests"])
    segs, idxs, execs, precs = [], [], [], []
    start = 0
    for (rid, n), (split, i) in zip(counts.items(), where):
        if n % n_layers or n // n_layers > SEGMENT:
            raise ValueError(f"request {rid}: {n} token-layers; replay needs whole tokens and at "
                             f"most {SEGMENT} tokens (the trace's segment length)")
        T = n // n_layers
        sl = slice(start, start + n)
        start += n
        segs.append((held if split == "heldout" else cal)[i][:T + 1])
        idxs.append(target[sl].reshape(T, n_layers, k))
        execs.append(exec_[sl].reshape(T, n_layers, k))
        precs.append(prec[sl].reshape(T, n_layers, k))
    if len({len(s) for s in segs}) > 1:
        raise ValueError("requests of different lengths; replay them per length")
    return PlanSet(np.stack(segs), np.stack(idxs), np.stack(execs), np.stack(precs)), where


def run_replay(run_dir: Path, model: ProxyMoE, corpus: Corpus, trace_path: Path,
               quality: QualityModel | None, ce_ref: float, check: bool = True
               ) -> tuple[pd.DataFrame, dict]:
    """Replay every completed request of ``run_dir``; writes the CSV and JSON described above."""
    meta = json.loads(meta_path(trace_path).read_text())
    if meta["model"] != model.cfg.model:
        raise ValueError(f"{trace_path} is a trace of {meta['model']}, not {model.cfg.model}")
    spec = yaml.safe_load((run_dir / "spec.resolved.yaml").read_text())
    tl, rq = read_records(run_dir)
    if rq.empty:
        raise ValueError(f"{run_dir}: no completed requests")
    rq = rq[rq.status == "ok"].sort_values("request")
    ids = [int(r) for r in rq.request]
    plans, where = plans_from_records(tl, ids, corpus, meta, model.cfg.n_layers, model.cfg.experts)
    if check:
        check_routing(plans, trace_path, model.cfg.model, ids)
    kl, ce0, ce1 = replay_plans(model, model.bank(), plans)
    df = pd.DataFrame({
        "request": ids, "split": [w[0] for w in where], "segment": [w[1] for w in where],
        "arrival_s": rq.arrival_s.to_numpy(), "tokens": plans.idx.shape[1],
        "lam_mean": rq.lam_mean.to_numpy(), "lam_max": rq.lam_max.to_numpy(),
        "kl_nats": kl.mean(1), "degradation": kl.mean(1) / ce_ref,
        "degradation_max_token": kl.max(1) / ce_ref,
        "ce_ref": ce0.mean(1), "ce_run": ce1.mean(1), "ppl_ratio": np.exp(ce1.mean(1) - ce0.mean(1)),
        "quantized": (plans.prec != Precision.FP16).sum((1, 2, 3)),
        "substituted": (plans.exec != plans.idx).sum((1, 2, 3)),
    })
    if quality is not None:
        lam = token_lambda(quality, plans.idx, plans.exec, plans.prec, model.cfg.experts)
        df["lam_recomputed"] = lam.mean(1)
        df["lam_recomputed_max"] = lam.max(1)
    df["measured"] = df.arrival_s >= spec["workload"]["warmup_s"]
    summary = summarise(df[df.measured], ce_ref)
    summary |= {"run": str(run_dir), "trace": str(trace_path), "model": model.cfg.model,
                "budget": spec["quality"]["budget"], "router": spec["router"]["name"],
                "profile": spec["quality"]["profile"], "ce_ref_nats": ce_ref,
                "wrapped_to_calibration_text": int((df.split == "calibration").sum())}
    df.to_csv(run_dir / "quality_replay.csv", index=False)
    (run_dir / "quality.json").write_text(json.dumps(summary, indent=1))
    return df, summary


def replay_run_dir(run_dir: Path, trace: Path | None = None, profile: Path | None = None,
                   cache: Path | None = None, log=lambda msg: None) -> dict:
    """Measured quality of one finished run, everything found from its resolved spec.

    Loads (or trains, on first use) the proxy of the run's model, the run's
    proxy trace and quality profile, replays, writes ``quality_replay.csv`` and
    ``quality.json`` into the run folder and returns the summary.
    """
    spec = yaml.safe_load((run_dir / "spec.resolved.yaml").read_text())
    name = get_model(spec["workload"]["model"]).name
    trace = trace or Path(spec["workload"]["trace"])
    if not trace.exists():
        raise ValueError(f"trace {trace} not found")
    prof = profile or (Path(spec["quality"]["profile"]) if spec["quality"]["profile"] != "prior" else None)
    corpus = load_corpus()
    if cache is None:  # the proxy that made the trace
        model, _ = trace_proxy(trace, corpus, log)
    else:
        model, _ = load_or_train(proxy_config(name), corpus, cache, log)
    quality = load_profile(prof, get_model(name).shape()) if prof is not None else None
    return run_replay(run_dir, model, corpus, trace, quality, reference_ce(prof, model, corpus))[1]
