"""Export the proxy's own routing on real text as a JSON-lines trace.

A run on this trace (``workload: {trace: PATH.jsonl}``) routes the very
tokens whose text the replay later re-executes. Request ids and text:

- ids 0..n-1: held-out segment r = held-out bytes [36 r, 36 r + 36) (+1 target);
- ids CALIBRATION_ID_BASE + i: calibration segment i (the profiling text), so
  the testbed's placement calibration (T_cal) stays on calibration text.

``JsonlTrace`` returns a present id's own routing; an absent id r maps to the
(r mod count)-th id in sorted order, count = n + the calibration requests. Keep
n at least the number of requests a run makes (rate x duration; default 512)
so that no evaluation request wraps (replay reports any that did). Tokens are
the 36 positions of a segment; a request of more tokens would wrap around
its segment, which replay refuses.

Next to ``PATH.jsonl`` goes ``PATH.meta.json``: model, proxy cache key, text
digest, segment length and the id -> (split, segment) table replay uses.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..traces import CALIBRATION_ID_BASE
from .data import Corpus, segments
from .model import ProxyConfig, ProxyMoE, proxy_config
from .profile import SEGMENT


def meta_path(trace: Path) -> Path:
    return trace.with_name(trace.name.removesuffix(".jsonl") + ".meta.json")


@torch.inference_mode()
def route_segments(model: ProxyMoE, seg: np.ndarray, batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """The gate's top-k (local ids) and weights, (S, T, L, k), full precision."""
    idx, w = [], []
    for start in range(0, len(seg), batch):
        tok = torch.from_numpy(seg[start:start + batch, :-1].astype(np.int64))
        out = model(tok)
        idx.append(out.idx.numpy())
        w.append(out.weights.numpy())
    return np.concatenate(idx), np.concatenate(w)


def export_trace(model: ProxyMoE, corpus: Corpus, path: Path, requests: int = 512,
                 calibration_requests: int = 64, cache_key: str = "") -> dict:
    """Write the trace and its sidecar; returns the sidecar's content."""
    cfg = model.cfg
    held = segments(corpus.heldout, SEGMENT, requests)
    cal = segments(corpus.calibration, SEGMENT, calibration_requests)
    ids = [("heldout", np.arange(requests), held), ("calibration", CALIBRATION_ID_BASE +
                                                     np.arange(calibration_requests), cal)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for _, rids, seg in ids:
            if len(seg) == 0:
                continue
            idx, w = route_segments(model, seg)
            for r, rid in enumerate(rids):
                for t in range(SEGMENT):
                    for layer in range(cfg.n_layers):
                        fh.write(json.dumps({
                            "request": int(rid), "token": t, "layer": layer,
                            "experts": idx[r, t, layer].tolist(),
                            "weights": [round(float(x), 6) for x in w[r, t, layer]]},
                            separators=(",", ":")) + "\n")
    meta = {"model": cfg.model, "proxy_key": cache_key, "proxy_config": asdict(cfg),
            "text_sha256": corpus.digest,
            "text": corpus.source, "segment_tokens": SEGMENT, "heldout_requests": requests,
            "calibration_requests": calibration_requests,
            "calibration_id_base": CALIBRATION_ID_BASE}
    meta_path(path).write_text(json.dumps(meta, indent=1))
    return meta


def file_request(request_id: int, meta: dict) -> tuple[str, int]:
    """(split, segment) of a run's request id, mapped as ``JsonlTrace`` maps it."""
    n, m, base = meta["heldout_requests"], meta["calibration_requests"], meta["calibration_id_base"]
    ids = [*range(n), *range(base, base + m)]  # sorted, as the reader sorts them
    present = request_id < n or base <= request_id < base + m
    rid = request_id if present else ids[request_id % len(ids)]
    return ("heldout", rid) if rid < n else ("calibration", rid - base)


def trace_proxy(trace: Path, corpus: Corpus, log=None) -> tuple[ProxyMoE, dict]:
    """The proxy whose routing ``trace`` holds, from the weight cache; and the sidecar.

    The sidecar names the proxy (its config, and its cache key); a cache that
    holds other weights under that config (changed training code or text) is
    an error rather than a silent retrain that would no longer match the trace.
    """
    from .train import cache_path, default_cache_dir, load_or_train

    meta = json.loads(meta_path(trace).read_text())
    cfg = ProxyConfig(**meta["proxy_config"]) if "proxy_config" in meta else proxy_config(meta["model"])
    key = cache_path(cfg, corpus, default_cache_dir()).stem
    if meta.get("proxy_key") and key != meta["proxy_key"]:
        raise ValueError(f"{trace} was made by proxy {meta['proxy_key']}, but this code and text "
                         f"give {key}; re-export it (make quality-profile)")
    return load_or_train(cfg, corpus, log=log)[0], meta
