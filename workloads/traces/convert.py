"""Convert recorded routing logs into the project's JSON-lines trace (``JsonlTrace``).

Two common shapes of log are read:

- ``hf``: Hugging Face Transformers' ``output_router_logits=True`` (Mixtral, Qwen-MoE,
  Switch): per request, the router logits of every layer, ``[L][T][E]``. Read from a
  ``.npz`` holding ``router_logits`` of shape (L, T, E) for one request or (R, L, T, E)
  for several (with an optional ``lengths`` (R,) that cuts padding), or from JSON lines
  ``{"request": id, "router_logits": [[[...E] x T] x L]}``. Top-k is taken from the
  logits, weights are the softmax over the top-k (Mixtral's rule).
- ``vllm``: per-layer JSON lines as serving engines log a fused-MoE step, one object per
  (request, layer, step): ``{"request_id": id, "layer": l, "topk_ids": [[k ids] per token],
  "topk_weights": [[k floats] per token], "positions": [token index per token]}``.
  ``request``/``req_id``, ``layer_id``, ``expert_ids``/``experts`` and
  ``weights``/``scores`` are accepted as synonyms; without ``positions`` the tokens of a
  (request, layer) are numbered in the order they appear; without weights the experts
  weigh the same (reported).

Cells that cannot be used are reported, never guessed silently:

- **missing**: a token lacks a layer (or its logits are not finite): the token is dropped
  and the request's later tokens renumbered, so every written token has all L layers;
- **tied**: two logits tie at the top-k boundary (the choice is the lower expert id, as
  ``torch.topk`` on CPU does), or a (request, token, layer) is logged twice with different
  experts (the first is kept); counted per kind;
- malformed records (bad JSON, ids out of range, k wrong) are skipped with their line.

``python -m workloads.traces convert --format hf|vllm IN OUT --model mixtral`` runs it
and prints the report; the written file is then loaded once as a ``JsonlTrace`` to prove
it reads back.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..models import ModelSpec

MAX_EXAMPLES = 5  # line numbers kept per kind of problem in the report


@dataclass
class ConvertReport:
    """What a conversion read, wrote and could not use."""

    records: int = 0
    requests: int = 0
    tokens_written: int = 0
    tokens_dropped_missing: int = 0
    ties_broken: int = 0
    duplicates_conflicting: int = 0
    weights_missing: int = 0
    skipped: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        """A malformed record, skipped; ``why`` names its place."""
        self.skipped += 1
        self.note("malformed", why)

    def note(self, kind: str, where: str) -> None:
        ex = self.examples.setdefault(kind, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(where)

    def format(self) -> str:
        lines = [f"read {self.records} records; wrote {self.requests} requests, "
                 f"{self.tokens_written} tokens"]
        for label, n in (("tokens dropped (a layer missing or not finite)", self.tokens_dropped_missing),
                         ("ties at the top-k boundary broken to the lower expert id", self.ties_broken),
                         ("cells logged twice with different experts (first kept)",
                          self.duplicates_conflicting),
                         ("records without weights (experts weigh the same)", self.weights_missing),
                         ("records skipped as malformed", self.skipped)):
            if n:
                lines.append(f"  {label}: {n}")
        for kind, where in self.examples.items():
            lines.append(f"  e.g. {kind}: {'; '.join(where)}")
        return "\n".join(lines)


# cells[request][(token, layer)] = (experts, weights)
Cells = dict[int, dict[tuple[int, int], tuple[list[int], list[float]]]]


def _topk_from_logits(logits: np.ndarray, k: int, report: ConvertReport, where: str
                      ) -> tuple[list[int], list[float]] | None:
    """Top-k experts of one token-layer and their softmax weights over the top-k;
    None for a cell that is not finite (missing)."""
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 1 or not np.isfinite(x).all():
        return None
    order = np.lexsort((np.arange(x.size), -x))  # by logit descending, then lower id
    top = order[:k]
    if k < x.size and x[order[k - 1]] == x[order[k]]:
        report.ties_broken += 1
        report.note("tie", where)
    z = np.exp(x[top] - x[top].max())
    return [int(e) for e in top], [float(w) for w in z / z.sum()]


def _hf_cells(path: Path, model: ModelSpec, report: ConvertReport) -> tuple[Cells, dict]:
    L, E, k = model.n_layers, model.experts_per_layer, model.top_k
    cells: Cells = {}
    missing: dict[int, set[int]] = {}

    def add(req: int, arr: np.ndarray, where: str) -> None:
        if arr.ndim != 3 or arr.shape[0] != L or arr.shape[2] != E:
            report.skip(f"{where}: router_logits of shape {arr.shape}, "
                        f"expected ({L}, T, {E})")
            return
        report.records += 1
        per = cells.setdefault(req, {})
        for tok in range(arr.shape[1]):
            for layer in range(L):
                got = _topk_from_logits(arr[layer, tok], k, report, f"{where} token {tok} layer {layer}")
                if got is None:
                    missing.setdefault(req, set()).add(tok)
                    report.note("missing", f"{where} token {tok} layer {layer}")
                else:
                    per[(tok, layer)] = got

    if path.suffix == ".npz":
        with np.load(path) as z:
            if "router_logits" not in z:
                raise ValueError(f"{path}: no 'router_logits' array (keys: {', '.join(z.files)})")
            logits = z["router_logits"]
            lengths = z["lengths"] if "lengths" in z else None
        if logits.ndim == 3:
            logits = logits[None]
        for r in range(logits.shape[0]):
            n = int(lengths[r]) if lengths is not None else logits.shape[2]
            add(r, logits[r, :, :n], f"{path.name} request {r}")
    else:
        for lineno, text in _lines(path):
            where = f"{path.name}:{lineno}"
            rec = _json(text, where, report)
            if rec is None:
                continue
            req = rec.get("request", rec.get("request_id"))
            if not isinstance(req, int) or isinstance(req, bool) or req < 0 or "router_logits" not in rec:
                report.skip(f"{where}: needs an integer request and router_logits")
                continue
            try:
                arr = np.asarray(rec["router_logits"], dtype=np.float64)
            except (TypeError, ValueError):
                report.skip(f"{where}: router_logits is not a numeric array")
                continue
            add(req, arr, where)
    return cells, missing


def _vllm_cells(path: Path, model: ModelSpec, report: ConvertReport) -> tuple[Cells, dict]:
    L, E, k = model.n_layers, model.experts_per_layer, model.top_k
    cells: Cells = {}
    missing: dict[int, set[int]] = {}
    ids: dict[object, int] = {}  # request ids as logged (strings too) -> 0, 1, ...
    next_pos: dict[tuple[int, int], int] = {}
    for lineno, text in _lines(path):
        where = f"{path.name}:{lineno}"
        rec = _json(text, where, report)
        if rec is None:
            continue
        raw_req = _first(rec, "request_id", "request", "req_id")
        layer = _first(rec, "layer", "layer_id")
        experts = _first(rec, "topk_ids", "expert_ids", "experts")
        weights = _first(rec, "topk_weights", "weights", "scores")
        if raw_req is None or not isinstance(layer, int) or not 0 <= layer < L or experts is None:
            report.skip(f"{where}: needs request_id, a layer in [0, {L}) and topk_ids")
            continue
        if experts and not isinstance(experts[0], list):  # one token logged flat
            experts = [experts]
            weights = [weights] if weights is not None else None
        if weights is None:
            report.weights_missing += 1
            weights = [[1.0] * len(row) for row in experts]
        pos = rec.get("positions")
        req = ids.setdefault(raw_req, len(ids))
        if pos is None:
            start = next_pos.get((req, layer), 0)
            pos = list(range(start, start + len(experts)))
        next_pos[(req, layer)] = max(pos) + 1 if len(pos) else next_pos.get((req, layer), 0)
        ok = (isinstance(pos, list) and len(pos) == len(experts) == len(weights)
              and all(isinstance(p, int) and p >= 0 for p in pos)
              and all(isinstance(row, list) and len(row) == k and len(set(row)) == k
                      and all(isinstance(e, int) and 0 <= e < E for e in row) for row in experts)
              and all(isinstance(row, list) and len(row) == k
                      and all(isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 for w in row)
                      and sum(row) > 0 for row in weights))
        if not ok:
            report.skip(f"{where}: positions, topk_ids ({k} distinct ids in [0, {E}) "
                        f"per token) and topk_weights must match")
            continue
        report.records += 1
        per = cells.setdefault(req, {})
        for p, row, w in zip(pos, experts, weights):
            cell = ([int(e) for e in row], [float(x) for x in w])
            if (p, layer) in per:
                if set(per[(p, layer)][0]) != set(cell[0]):
                    report.duplicates_conflicting += 1
                    report.note("duplicate", f"{where} token {p} layer {layer}")
                continue
            per[(p, layer)] = cell
    return cells, missing


def _first(rec: dict, *keys: str):
    for key in keys:
        if key in rec:
            return rec[key]
    return None


def _lines(path: Path):
    with path.open("r", encoding="utf-8") as fh:
        for lineno, text in enumerate(fh, start=1):
            if text.strip():
                yield lineno, text


def _json(text: str, where: str, report: ConvertReport) -> dict | None:
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as err:
        report.skip(f"{where}: invalid JSON ({err.msg})")
        return None
    if not isinstance(rec, dict):
        report.skip(f"{where}: not a JSON object")
        return None
    return rec


def convert(src: str | Path, dst: str | Path, model: ModelSpec, fmt: str) -> ConvertReport:
    """Read ``src`` (``fmt`` 'hf' or 'vllm'), write the project's JSON lines to ``dst``."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise ValueError(f"{src}: no such file")
    report = ConvertReport()
    if fmt == "hf":
        cells, missing = _hf_cells(src, model, report)
    elif fmt == "vllm":
        cells, missing = _vllm_cells(src, model, report)
    else:
        raise ValueError(f"format must be 'hf' or 'vllm', got {fmt!r}")
    L = model.n_layers
    with dst.open("w", encoding="utf-8") as fh:
        for req in sorted(cells):
            per = cells[req]
            tokens = sorted({t for t, _ in per} | missing.get(req, set()))
            out_tok = 0
            for tok in tokens:
                if tok in missing.get(req, set()) or any((tok, layer) not in per for layer in range(L)):
                    report.tokens_dropped_missing += 1
                    absent = [layer for layer in range(L) if (tok, layer) not in per]
                    if absent and tok not in missing.get(req, set()):
                        report.note("missing", f"request {req} token {tok} lacks layer(s) {absent[:4]}")
                    continue
                for layer in range(L):
                    experts, weights = per[(tok, layer)]
                    fh.write(json.dumps({"request": req, "token": out_tok, "layer": layer,
                                         "experts": experts, "weights": weights}) + "\n")
                out_tok += 1
            if out_tok:
                report.requests += 1
                report.tokens_written += out_tok
    if not report.tokens_written:
        raise ValueError(f"{src}: no complete token in the log\n{report.format()}")
    return report
