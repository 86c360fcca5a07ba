"""One token through a proxy, one layer at a time, as emulated workers run it (issue 6).

The emulator moves one token's hidden state per layer between servers. With
``quality.inrun`` the state is the proxy's real residual stream: the server
where the token resides runs the non-expert part of the layer (attention, and
Switch's dense block), each participant runs its experts on the normalised
state at its replica's precision (``model.bank()``: the fake quantisation the
profile and the replay use), the aggregator adds the gate-weighted partial
sums (and Qwen's shared expert) to the residual, and the home server turns the
final state into next-byte probabilities and compares them with the exact
full-precision reference: KL in nats and cross-entropy per token.

Attention context: prompt tokens travel independently (the paper's per-token
model), so when position p is at layer l the other positions may not have
reached l. A token therefore attends to the *reference* keys and values of the
earlier positions of its text and to its own key and value from the run's
state. What a token's in-run loss measures is the effect of its own routing
choices through every layer, which is what the surrogate Lambda (eq. 8)
accumulates per token; errors that earlier positions would pass on through
attention are left out. The post-run replay (``replay``) re-executes whole
requests and includes them; for the first position, and whenever only the
last position is perturbed, the two agree (tests/test_proxy_inrun.py).

This module is the model side (``ProxyStepper``); the texts of a run's
requests, the workers' result lines and their merge into ``quality_inrun.csv``
are ``testbed.quality_inrun``.

Gate weights are recomputed from the run's state with the routing fixed to
the trace's targets, as the replay does (``model.MoEBlock.gate``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .model import Plan, ProxyMoE, _ffn
from .profile import kl_rows


@dataclass(frozen=True)
class _Reference:
    """One request's exact pass: per attention block K and V (heads, T, dh), and log-probs."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    logp: torch.Tensor  # (T, vocab) float64
    tokens: torch.Tensor  # (T + 1,) int64: the text, the last byte is only a target


class ProxyStepper:
    """Per-token, per-layer execution of ``model`` on the texts of a run's requests.

    ``texts`` maps request id -> bytes (at least tokens + 1 values). Each
    request's exact reference is computed once, in batches, by ``prepare``,
    with the experts ``routes(rid)`` gives ((tokens, L, k) local ids: the
    trace's targets, which the run follows) or, without it, the proxy's own
    top-k (the same experts, unless a near-tie rounds the other way).
    """

    def __init__(self, model: ProxyMoE, texts: Mapping[int, np.ndarray],
                 routes: Callable[[int], np.ndarray] | None = None) -> None:
        self.model = model
        self.routes = routes
        self.cfg = model.cfg
        self.bank = model.bank()
        self.texts = {int(r): np.asarray(t, dtype=np.int64) for r, t in texts.items()}
        self.refs: dict[int, _Reference] = {}
        self.dh = self.cfg.d_model // self.cfg.n_heads

    # -- the exact reference ---------------------------------------------------------
    def _kv(self, attn, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, d = h.shape
        qkv = F.linear(attn.norm(h), attn.qkv).view(B, T, 3, attn.heads, self.dh)
        return qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)

    @torch.inference_mode()
    def prepare(self, request_ids=None, batch: int = 64) -> None:
        """Compute the reference of ``request_ids`` (default: every text), batched by length."""
        ids = sorted(self.texts if request_ids is None else request_ids)
        by_len: dict[int, list[int]] = {}
        for r in ids:
            if r not in self.refs:
                by_len.setdefault(len(self.texts[r]), []).append(r)
        m = self.model
        for length, rids in by_len.items():
            if length - 1 > self.cfg.context:
                raise ValueError(f"text of {length - 1} tokens exceeds the proxy's context "
                                 f"{self.cfg.context}")
            for s in range(0, len(rids), batch):
                chunk = rids[s:s + batch]
                text = torch.from_numpy(np.stack([self.texts[r] for r in chunk]))
                h = m.embed_tokens(text[:, :-1])
                plan = None if self.routes is None else Plan.exact(torch.from_numpy(
                    np.stack([np.asarray(self.routes(r), dtype=np.int64) for r in chunk])))
                kvs = []
                for layer in range(self.cfg.n_layers):
                    if m.dense is not None:
                        kvs.append(self._kv(m.dense[layer].attn, h))
                        h = m.dense[layer](h)
                    kvs.append(self._kv(m.moe[layer].attn, h))
                    h = m.moe[layer](h, layer, plan, None)[0]
                logp = torch.log_softmax(F.linear(m.norm(h), m.head).double(), dim=-1)
                for b, r in enumerate(chunk):
                    self.refs[r] = _Reference([(k[b].clone(), v[b].clone()) for k, v in kvs],
                                              logp[b].clone(), text[b].clone())

    def _ref(self, rid: int) -> _Reference:
        ref = self.refs.get(rid)
        if ref is None:
            self.prepare([rid])
            ref = self.refs[rid]
        return ref

    # -- one token, one layer ------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, rid: int, pos: int) -> torch.Tensor:
        """The residual stream (d,) entering the first layer."""
        ref = self._ref(rid)
        return self.model.embed[ref.tokens[pos]] + self.model.pos[pos]

    def _attend(self, attn, kv: tuple[torch.Tensor, torch.Tensor], pos: int,
                h: torch.Tensor) -> torch.Tensor:
        heads = attn.heads
        q, k, v = F.linear(attn.norm(h), attn.qkv).view(3, heads, 1, self.dh).unbind(0)
        keys = torch.cat((kv[0][:, :pos], k), dim=1)  # reference context, then our own
        vals = torch.cat((kv[1][:, :pos], v), dim=1)
        a = F.scaled_dot_product_attention(q, keys, vals)
        return F.linear(a.reshape(heads * self.dh), attn.out)

    @torch.inference_mode()
    def attend(self, rid: int, pos: int, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Where the token resides: the layer up to the experts (returns the residual)."""
        ref = self._ref(rid)
        m = self.model
        i = layer * (2 if m.dense is not None else 1)
        if m.dense is not None:
            blk = m.dense[layer]
            h = h + self._attend(blk.attn, ref.kv[i], pos, h)
            h = h + _ffn(blk.norm(h), blk.w_in, blk.w_out, swiglu=False)
            i += 1
        return h + self._attend(m.moe[layer].attn, ref.kv[i], pos, h)

    @torch.inference_mode()
    def moe_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.model.moe[layer].norm(h)

    @torch.inference_mode()
    def gate(self, layer: int, x: torch.Tensor, targets) -> torch.Tensor:
        """Gate weights (k,) of the fixed ``targets`` (local ids) for the input ``x`` (d,)."""
        idx = torch.as_tensor(list(targets), dtype=torch.int64)[None]
        return self.model.moe[layer].gate(x[None], idx)[1][0]

    @torch.inference_mode()
    def expert(self, layer: int, expert: int, precision: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert`` of ``layer`` at ``precision`` on inputs ``x`` (B, d)."""
        b = self.bank
        return _ffn(x, b.w_in[layer][precision, expert], b.w_out[layer][precision, expert],
                    self.cfg.swiglu)

    @torch.inference_mode()
    def combine(self, layer: int, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The aggregator: residual + the routed experts' sum (+ Qwen's gated shared expert)."""
        out = h + routed
        blk = self.model.moe[layer]
        if self.cfg.shared_d_ff:
            x = blk.norm(h)
            out = out + torch.sigmoid(F.linear(x, blk.shared_gate)) * _ffn(
                x, blk.shared_in, blk.shared_out, swiglu=True)
        return out

    @torch.inference_mode()
    def score(self, rid: int, pos: int, h: torch.Tensor) -> tuple[float, float, float]:
        """(KL(ref || run) nats, CE of the reference, CE of the run) of the next byte."""
        ref = self._ref(rid)
        logits = F.linear(self.model.norm(h), self.model.head)
        ref_logp = ref.logp[pos]
        kl = float(kl_rows(ref_logp[None], logits[None])[0])
        tgt = int(ref.tokens[pos + 1])
        ce_run = float(-torch.log_softmax(logits.double(), dim=-1)[tgt])
        return kl, float(-ref_logp[tgt]), ce_run
