"""In-run quality of an emulated run (``quality.inrun``): the run's side of issue 6.

The workers execute the proxy one token and one layer at a time with
``workloads.proxy.inrun.ProxyStepper`` (see its docstring for what is
measured); this module gives them the proxy and the texts of the run's
requests (``stepper_for_run``), names the folder their per-request lines go
to (``INRUN_DIR``) and merges those lines into ``quality_inrun.csv`` after the
run (``collect``), beside the replay (``testbed.quality_replay``) where both ran.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from workloads.models import get_model
from workloads.proxy.data import load_corpus, segments
from workloads.proxy.inrun import ProxyStepper
from workloads.proxy.profile import SEGMENT
from workloads.proxy.replay import _spearman, summarise
from workloads.proxy.trace import file_request, trace_proxy

from .records import flat, read_records


def run_texts(spec, meta: dict, corpus, request_ids) -> dict[int, np.ndarray]:
    """Text of each request of a run on a proxy trace: its segment, prompt + gen tokens + 1."""
    if meta["model"] != get_model(spec.workload.model).name:
        raise ValueError(f"the trace is of {meta['model']}, not {spec.workload.model}")
    n_tok = spec.workload.prompt_tokens + spec.workload.gen_tokens
    if n_tok > SEGMENT:
        raise ValueError(f"in-run quality needs at most {SEGMENT} tokens per request "
                         f"(prompt + gen = {n_tok})")
    segs = {"heldout": segments(corpus.heldout, SEGMENT, meta["heldout_requests"]),
            "calibration": segments(corpus.calibration, SEGMENT, meta["calibration_requests"])}
    out = {}
    for r in request_ids:
        split, i = file_request(int(r), meta)
        out[int(r)] = segs[split][i][:n_tok + 1]
    return out


def stepper_for_run(spec, request_ids, routes: Callable[[int], np.ndarray] | None = None,
                    log=lambda msg: None) -> ProxyStepper:
    """The proxy that made the run's trace (from the weight cache) and the requests' texts."""
    corpus = load_corpus()
    model, meta = trace_proxy(Path(spec.workload.trace), corpus, log)
    torch.set_grad_enabled(False)
    return ProxyStepper(model, run_texts(spec, meta, corpus, request_ids), routes)


# -- results ---------------------------------------------------------------------------

INRUN_DIR = "quality_inrun"  # per-worker JSON lines, one line per finished request


def _choices(run_dir: Path) -> pd.DataFrame:
    """Per request: quantized and substituted expert slots, from the token-layer records."""
    tl, _ = read_records(run_dir)
    prec, target, ex = (flat(tl[c]) for c in ("precision", "target", "exec_expert"))
    return pd.DataFrame({"request": tl.request.to_numpy(), "quantized": (prec != 0).sum(1),
                         "substituted": (target != ex).sum(1)}).groupby("request", as_index=False).sum()


def collect(run_dir: Path, ce_ref: float, warmup_s: float) -> tuple[pd.DataFrame, dict]:
    """Merge the workers' in-run lines into ``quality_inrun.csv``; summary as the replay's.

    Where the run was also replayed (``quality_replay.csv``), the summary adds
    how the two measurements relate per request.
    """
    rows = []
    for f in sorted((run_dir / INRUN_DIR).glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    if not rows:  # e.g. every request failed: nothing measured, the run's other results stand
        return pd.DataFrame(), {"requests": 0}
    # one line per request; a line repeated (a worker restarted into this folder) counts once
    df = (pd.DataFrame(rows).drop_duplicates("request", keep="last")
          .sort_values("request", kind="stable").reset_index(drop=True))
    kl = df.pop("kl_tokens").map(np.asarray)
    ce0, ce1 = df.pop("ce_ref_tokens").map(np.asarray), df.pop("ce_run_tokens").map(np.asarray)
    df["kl_nats"] = kl.map(np.mean)
    df["kl_first_token"] = kl.map(lambda a: float(a[0]))
    df["degradation"] = df.kl_nats / ce_ref
    df["degradation_max_token"] = kl.map(np.max) / ce_ref
    df["ce_ref"], df["ce_run"] = ce0.map(np.mean), ce1.map(np.mean)
    df["ppl_ratio"] = np.exp(df.ce_run - df.ce_ref)
    df["measured"] = df.arrival_s >= warmup_s
    df = df.merge(_choices(run_dir), on="request", how="left")
    df.to_csv(run_dir / "quality_inrun.csv", index=False)
    summary = summarise(df[df.measured], ce_ref)
    rep = run_dir / "quality_replay.csv"
    if rep.exists():
        r = pd.read_csv(rep)[["request", "degradation"]].rename(columns={"degradation": "replay"})
        j = df[df.measured].merge(r, on="request")
        if len(j):
            rho, _ = _spearman(j.degradation.to_numpy(), j.replay.to_numpy())
            summary |= {"replay_requests": int(len(j)), "replay_spearman_rho": rho,
                        "replay_degradation_mean": float(j.replay.mean()),
                        "inrun_over_replay": float(j.degradation.mean() / j.replay.mean())
                        if j.replay.mean() > 0 else math.nan}
    return df, summary
