"""In-run quality (``quality.inrun``): the trained proxy's real hidden states and
experts on the worker, and each finished request's scores written beside the run.

Routing stays the trace's (as in replay); only the numbers the experts compute
and the scores against the exact reference come from the proxy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ...quality_inrun import INRUN_DIR, stepper_for_run
from ..experts import ProxyBank


class InrunQuality:
    """The proxy stepper of one worker and its ``w<rank>.jsonl`` score file."""

    def __init__(self, spec, setup, run_dir: str, rank: int, replicas: dict) -> None:
        n_tok = spec.workload.prompt_tokens + spec.workload.gen_tokens
        self.proxy = stepper_for_run(  # the reference follows the trace's experts, as the run
            spec, [rq.id for rq in setup.requests],
            lambda rid: np.asarray(setup.routing(rid, n_tok).experts))
        self.proxy.prepare()  # every request's exact reference, before the clock starts
        self.E = setup.shape.experts_per_layer
        self.bank = ProxyBank(self.proxy, replicas, self.E)
        self.d = self.proxy.cfg.d_model
        qdir = Path(run_dir) / INRUN_DIR
        qdir.mkdir(parents=True, exist_ok=True)
        self.file = open(qdir / f"w{rank}.jsonl", "w", encoding="utf-8")

    def embed(self, rid: int, index: int) -> torch.Tensor:
        return self.proxy.embed(rid, index)

    def attend(self, rid: int, index: int, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The layer's attention (and dense block), run where the token resides."""
        return self.proxy.attend(rid, index, layer, h)

    def expert_input(self, layer: int, x: torch.Tensor, targets) -> tuple[torch.Tensor, list[float]]:
        """(the experts' input, gate weight per target) from the real state; the targets
        are the trace's (global ids), so routing is fixed as in replay."""
        x = self.proxy.moe_input(layer, x)
        return x, self.proxy.gate(layer, x, [e - layer * self.E for e in targets]).tolist()

    def combine(self, layer: int, hidden: torch.Tensor, partials) -> torch.Tensor:
        routed = torch.zeros_like(hidden)
        for part in partials:
            routed += part
        return self.proxy.combine(layer, hidden, routed)

    def score(self, rid: int, index: int, out: torch.Tensor) -> tuple[float, float, float]:
        """(KL, CE of the reference, CE of the run) of one finished token."""
        return self.proxy.score(rid, index, out)

    def write(self, rq, lam_mean: float, lam_max: float) -> None:
        sc = [rq.scores[i] for i in sorted(rq.scores)]
        self.file.write(json.dumps({
            "request": rq.rid, "arrival_s": rq.arrival, "tokens": len(sc),
            "lam_mean": lam_mean, "lam_max": lam_max,
            "kl_tokens": [s[0] for s in sc], "ce_ref_tokens": [s[1] for s in sc],
            "ce_run_tokens": [s[2] for s in sc]}) + "\n")
        self.file.flush()  # a killed run keeps every finished request

    def close(self) -> None:
        self.file.close()
