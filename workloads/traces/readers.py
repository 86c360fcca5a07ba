"""Recorded traces in the project's JSON-lines format: ``JsonlTrace`` and ``write_jsonl``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

import numpy as np

from ..models import ModelSpec
from .generator import CALIBRATION_ID_BASE, Routing, TraceSource, readonly, validate_request


class TraceFormatError(ValueError):
    """A trace file that does not load; the message is one line naming file and line."""


_KEYS = ("request", "token", "layer", "experts", "weights")


def _parse_line(text: str, where: str, model: ModelSpec) -> tuple[int, int, int, list[int], list[float]]:
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: invalid JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    missing = [key for key in _KEYS if key not in rec]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    req, tok, layer, experts, weights = (rec[key] for key in _KEYS)
    for key, v in (("request", req), ("token", tok), ("layer", layer)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise TraceFormatError(f"{where}: {key} must be a non-negative integer")
    if not 0 <= layer < model.n_layers:
        raise TraceFormatError(f"{where}: layer {layer} outside [0, {model.n_layers})")
    if not isinstance(experts, list) or len(experts) != model.top_k:
        raise TraceFormatError(f"{where}: experts must list top_k={model.top_k} experts")
    E = model.experts_per_layer
    if any(not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < E for e in experts):
        raise TraceFormatError(f"{where}: expert ids must be integers in [0, {E})")
    if len(set(experts)) != len(experts):
        raise TraceFormatError(f"{where}: experts must be distinct")
    if (not isinstance(weights, list) or len(weights) != len(experts)
            or any(not isinstance(w, (int, float)) or isinstance(w, bool) for w in weights)):
        raise TraceFormatError(f"{where}: weights must be {len(experts)} numbers")
    if any(not (w >= 0 and math.isfinite(w)) for w in weights) or sum(weights) <= 0:
        raise TraceFormatError(f"{where}: weights must be finite, >= 0 and not all 0")
    return req, tok, layer, experts, [float(w) for w in weights]


class JsonlTrace:
    """A recorded trace: one JSON object per line and token-layer.

    ``{"request": int, "token": int, "layer": int, "experts": [k ids],
    "weights": [k floats]}``. Experts are reordered by weight (descending) and
    weights renormalized. Every request needs tokens 0..T-1, each with all L
    layers. A request id present in the file returns that request; any other
    id maps to file request (id mod count) in sorted-id order. Asking for more
    tokens than a request has wraps around its tokens.

    ``holdout`` > 0 reserves the last share of the file's requests for ids at
    or above ``CALIBRATION_ID_BASE`` (calibration) and the rest for all other
    ids, so calibration stays held out on a real trace too.
    """

    def __init__(self, path: str | Path, model: ModelSpec, holdout: float = 0.0) -> None:
        if not 0.0 <= holdout < 1.0:
            raise ValueError("holdout must be in [0, 1)")
        self.path = Path(path)
        self.model = model
        self._requests = self._load()
        ids = sorted(self._requests)
        n_hold = math.ceil(holdout * len(ids)) if holdout else 0
        if holdout and n_hold >= len(ids):
            raise TraceFormatError(f"{self.path}: too few requests ({len(ids)}) for holdout={holdout}")
        self._eval_ids = tuple(ids[: len(ids) - n_hold])
        self._calib_ids = tuple(ids[len(ids) - n_hold:]) if n_hold else tuple(ids)
        self.request_ids = tuple(ids)

    def _load(self) -> dict[int, Routing]:
        cells: dict[int, dict[tuple[int, int], tuple[list[int], list[float]]]] = {}
        with self.path.open("r", encoding="utf-8") as fh:
            for lineno, text in enumerate(fh, start=1):
                if not text.strip():
                    continue
                where = f"{self.path}:{lineno}"
                req, tok, layer, experts, weights = _parse_line(text, where, self.model)
                per_req = cells.setdefault(req, {})
                if (tok, layer) in per_req:
                    raise TraceFormatError(f"{where}: duplicate request {req} token {tok} layer {layer}")
                per_req[(tok, layer)] = (experts, weights)
        if not cells:
            raise TraceFormatError(f"{self.path}: no records")
        return {req: self._assemble(req, per_req) for req, per_req in cells.items()}

    def _assemble(self, req: int, per_req: dict) -> Routing:
        L, k = self.model.n_layers, self.model.top_k
        n = 1 + max(tok for tok, _ in per_req)
        experts = np.empty((n, L, k), dtype=np.int64)
        weights = np.empty((n, L, k))
        for tok in range(n):
            for layer in range(L):
                if (tok, layer) not in per_req:
                    raise TraceFormatError(
                        f"{self.path}: request {req} token {tok} is missing layer {layer}")
                e, w = per_req[(tok, layer)]
                order = np.argsort(-np.asarray(w), kind="stable")
                experts[tok, layer] = np.asarray(e)[order]
                weights[tok, layer] = np.asarray(w)[order] / sum(w)
        return Routing(readonly(experts), readonly(weights))

    def _file_request(self, request_id: int) -> Routing:
        pool = self._calib_ids if request_id >= CALIBRATION_ID_BASE else self._eval_ids
        if request_id not in pool:
            request_id = pool[request_id % len(pool)]
        return self._requests[request_id]

    def route(self, request_id: int, n_tokens: int, task: int = 0) -> Routing:
        """``task`` is accepted and ignored: a recorded trace has its own tasks."""
        validate_request(request_id, n_tokens)
        src = self._file_request(int(request_id))
        idx = np.arange(int(n_tokens)) % len(src.experts)
        return Routing(src.experts[idx], src.weights[idx])

    def tokens(self, request_id: int, n_tokens: int, task: int = 0) -> np.ndarray:
        return self.route(request_id, n_tokens).experts


def write_jsonl(path: str | Path, source: TraceSource, request_ids: Iterable[int], n_tokens: int) -> None:
    """Export ``n_tokens`` tokens of each request of any trace source as JSON lines."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for rid in request_ids:
            routing = source.route(int(rid), n_tokens)
            n, L, _ = routing.experts.shape
            for tok in range(n):
                for layer in range(L):
                    fh.write(json.dumps({
                        "request": int(rid), "token": tok, "layer": layer,
                        "experts": [int(e) for e in routing.experts[tok, layer]],
                        "weights": [float(w) for w in routing.weights[tok, layer]],
                    }) + "\n")
