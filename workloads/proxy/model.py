"""Small proxy MoE language models with the routing shape of the evaluated models.

A proxy has exactly the MoE layers, experts per layer and top-k of its
catalogue model (``workloads.models``), so its expert ids are the real model's
ids and a profile measured on it loads for the real shape. Everything else is
tiny (d_model 64, or 32 for Qwen's 1440 experts; 4 heads; byte vocabulary) so
it trains, and is profiled, on one CPU core in minutes.
Per model the parts that change how expert errors propagate are kept:

- Mixtral: SwiGLU experts, softmax over the top-k logits (renormalised).
- Qwen1.5-MoE: SwiGLU experts, softmax over all experts without
  renormalisation (``norm_topk_prob`` false) and a shared SwiGLU expert behind
  a sigmoid gate.
- Switch: ReLU experts, top-1 scaled by its softmax probability, and a dense
  ReLU block before every MoE block (``sparse_step`` 2). The proxy is a
  decoder-only causal LM: Switch's 6 encoder + 6 decoder MoE layers become 12
  MoE layers of one stack (one text stream, as the replay needs).

Layers are pre-norm (RMSNorm) with causal self-attention and learned position
embeddings. One forward serves training, profiling and replay: it either
routes with its own gate, or follows a ``Plan`` that fixes the gated experts
(teacher-forced routing, gate weights recomputed from the current hidden
state) and says which expert at which precision executes each gated slot.
Fixing the routing is what a trace-driven run implies: the records hold the
full-precision model's targets, and a perturbed hidden state must not change
them; it also keeps the measured losses smooth in the perturbation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hetroute.system import Precision

from ..models import get_model
from .quant import quantize

N_PREC = len(Precision)
_PACKED_BELOW = 128  # mean slots per expert below which experts run as one padded bmm


@dataclass(frozen=True)
class ProxyConfig:
    """Architecture and training recipe of one proxy; its hash keys the weight cache."""

    model: str  # catalogue name
    n_layers: int  # MoE layers (L)
    experts: int  # per layer
    top_k: int
    d_model: int = 64
    n_heads: int = 4
    expert_d_ff: int = 128
    swiglu: bool = True
    renorm_topk: bool = True  # Mixtral: softmax over the top-k logits only
    shared_d_ff: int = 0  # Qwen: shared SwiGLU expert with a sigmoid gate
    dense_d_ff: int = 0  # Switch: a dense ReLU block before every MoE block
    context: int = 48
    vocab: int = 256
    steps: int = 600
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 30
    aux_loss: float = 0.01  # Switch-style load balancing, keeps every expert in use
    seed: int = 0

    def key(self, corpus_digest: str, code: str) -> str:
        """Cache key: this config, the training text and the training code."""
        blob = json.dumps({"cfg": asdict(self), "text": corpus_digest, "code": code}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]


def proxy_config(model: str, **overrides) -> ProxyConfig:
    """The default proxy of a catalogue model (name or alias)."""
    spec = get_model(model)
    base = dict(model=spec.name, n_layers=spec.n_layers, experts=spec.experts_per_layer,
                top_k=spec.top_k)
    if spec.name == "qwen1.5-moe-a2.7b":
        # 60 fine-grained experts: narrow experts and a wider shared one, as in the real model;
        # d_model 32 because profiling measures 4 perturbations of each of 1440 experts.
        base |= dict(d_model=32, expert_d_ff=16, shared_d_ff=64, renorm_topk=False, steps=400)
    elif spec.name == "switch-base-8":
        base |= dict(swiglu=False, renorm_topk=False, dense_d_ff=128, steps=400)
    elif spec.name == "mixtral-8x7b":
        base |= dict(expert_d_ff=64, steps=300)
    return ProxyConfig(**(base | overrides))


def tiny_config(model: str, **overrides) -> ProxyConfig:
    """A seconds-to-train variant with the same routing shape (for tests)."""
    cfg = proxy_config(model)
    small = dict(d_model=16, n_heads=2, expert_d_ff=8, context=36, steps=4, batch=4, warmup=1,
                 shared_d_ff=16 if cfg.shared_d_ff else 0, dense_d_ff=16 if cfg.dense_d_ff else 0)
    return replace(cfg, **(small | overrides))


class Plan(NamedTuple):
    """Fixed routing and execution, each ``(B, T, L, k)`` int64.

    ``idx`` are the gated (target) experts, local ids; ``exec`` the expert
    that serves each slot (``idx`` itself, or a substitute of the same layer);
    ``prec`` its ``Precision``.
    """

    idx: torch.Tensor
    exec: torch.Tensor
    prec: torch.Tensor

    @staticmethod
    def exact(idx: torch.Tensor) -> "Plan":
        return Plan(idx, idx, torch.zeros_like(idx))


class Forward(NamedTuple):
    logits: torch.Tensor  # (B, T, vocab)
    idx: torch.Tensor  # (B, T, L, k) gated experts
    weights: torch.Tensor  # (B, T, L, k) gate weights
    aux: torch.Tensor  # load-balancing loss, averaged over layers
    moe_in: list[torch.Tensor] | None  # per layer: normalised MoE input (B, T, d)
    moe_out: list[torch.Tensor] | None  # per layer: residual stream after the MoE block


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> nn.Parameter:
    return nn.Parameter(torch.randn(shape, generator=gen) * std)


class Attention(nn.Module):
    def __init__(self, cfg: ProxyConfig, gen: torch.Generator, out_std: float) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.n_heads
        self.norm = nn.RMSNorm(d)
        self.qkv = _normal((3 * d, d), d ** -0.5, gen)
        self.out = _normal((d, d), out_std, gen)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, d = h.shape
        q, k, v = (F.linear(self.norm(h), self.qkv)
                   .view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(a.transpose(1, 2).reshape(B, T, d), self.out)


def _ffn(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """ReLU FFN, or SwiGLU with ``w_in`` = [gate; up] stacked by rows.

    Gate and up run as two matmuls on contiguous row blocks: elementwise ops
    on the strided halves of one wide output are ~5x slower on a CPU.
    """
    if swiglu:
        half = w_in.shape[0] // 2
        return F.linear(F.silu(F.linear(x, w_in[:half])) * F.linear(x, w_in[half:]), w_out)
    return F.linear(F.relu(F.linear(x, w_in)), w_out)


def _ffn_batched(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """``_ffn`` per group: x (G, C, d), w_in (G, h, d), w_out (G, d, f)."""
    if swiglu:
        half = w_in.shape[1] // 2
        g = torch.bmm(x, w_in[:, :half].transpose(1, 2))
        u = torch.bmm(x, w_in[:, half:].transpose(1, 2))
        return torch.bmm(F.silu(g) * u, w_out.transpose(1, 2))
    return torch.bmm(F.relu(torch.bmm(x, w_in.transpose(1, 2))), w_out.transpose(1, 2))


class DenseBlock(nn.Module):
    """Attention then a dense ReLU FFN (Switch's non-MoE blocks)."""

    def __init__(self, cfg: ProxyConfig, gen: torch.Generator, out_std: float) -> None:
        super().__init__()
        self.attn = Attention(cfg, gen, out_std)
        self.norm = nn.RMSNorm(cfg.d_model)
        self.w_in = _normal((cfg.dense_d_ff, cfg.d_model), cfg.d_model ** -0.5, gen)
        self.w_out = _normal((cfg.d_model, cfg.dense_d_ff), out_std, gen)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(h)
        return h + _ffn(self.norm(h), self.w_in, self.w_out, swiglu=False)


class MoEBlock(nn.Module):
    """Attention then the routed experts (plus Qwen's gated shared expert)."""

    def __init__(self, cfg: ProxyConfig, gen: torch.Generator, out_std: float) -> None:
        super().__init__()
        d, E = cfg.d_model, cfg.experts
        self.cfg = cfg
        self.attn = Attention(cfg, gen, out_std)
        self.norm = nn.RMSNorm(d)
        self.router = _normal((E, d), d ** -0.5, gen)
        width = (2 if cfg.swiglu else 1) * cfg.expert_d_ff
        self.w_in = _normal((E, width, d), d ** -0.5, gen)
        self.w_out = _normal((E, d, cfg.expert_d_ff), out_std, gen)
        if cfg.shared_d_ff:
            self.shared_in = _normal((2 * cfg.shared_d_ff, d), d ** -0.5, gen)
            self.shared_out = _normal((d, cfg.shared_d_ff), out_std, gen)
            self.shared_gate = _normal((1, d), d ** -0.5, gen)

    def gate(self, x: torch.Tensor, idx: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(idx, weights, logits) for tokens ``x`` (N, d); ``idx`` given = teacher-forced."""
        logits = F.linear(x, self.router)
        if idx is None:
            idx = logits.topk(self.cfg.top_k, dim=-1).indices
        if self.cfg.renorm_topk:
            w = torch.softmax(logits.gather(1, idx), dim=-1)
        else:
            w = torch.softmax(logits, dim=-1).gather(1, idx)
        return idx, w, logits

    def experts(self, x: torch.Tensor, w: torch.Tensor, exec_: torch.Tensor, prec: torch.Tensor,
                bank: "ExpertBank | None", layer: int) -> torch.Tensor:
        """sum_j w_j * Expert_{exec_j}^{prec_j}(x) for every token.

        Two equivalent implementations (equal up to float rounding): with few
        slots per expert (Qwen's 60 experts in training batches) per-expert
        calls are dominated by op overhead and one padded bmm is ~1.6x faster;
        with many (profiling and replay batches) padding and small-batch bmm
        make it ~2x slower than a call per group. The choice depends only on
        the shapes, so a pass and its exact replay take the same path.
        """
        if exec_.numel() < _PACKED_BELOW * self.cfg.experts:
            return self._experts_packed(x, w, exec_, prec, bank, layer)
        return self._experts_loop(x, w, exec_, prec, bank, layer)

    def _experts_packed(self, x: torch.Tensor, w: torch.Tensor, exec_: torch.Tensor,
                        prec: torch.Tensor, bank: "ExpertBank | None", layer: int) -> torch.Tensor:
        """All groups in one zero-padded (groups, capacity, d) bmm: a few ops per
        layer instead of a few per expert; fastest when groups are small."""
        N, k = exec_.shape
        key = (exec_ * N_PREC + prec).reshape(-1)
        order = torch.argsort(key, stable=True)
        skey = key[order]
        counts = torch.bincount(key, minlength=self.cfg.experts * N_PREC)
        gid = counts.nonzero().squeeze(1)
        remap = torch.zeros_like(counts)
        remap[gid] = torch.arange(len(gid))
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(N * k) - starts[skey]
        group = remap[skey]
        tok = order // k
        buf = x.new_zeros(len(gid), int(counts.max()), x.shape[1])
        buf[group, rank] = x[tok]
        if bank is None:
            if bool((gid % N_PREC).any()):
                raise ValueError("quantized execution needs an ExpertBank")
            w_in, w_out = self.w_in[gid // N_PREC], self.w_out[gid // N_PREC]
        else:  # bank tensors are (N_PREC, E, ...); group id = e * N_PREC + c
            w_in = bank.w_in[layer][gid % N_PREC, gid // N_PREC]
            w_out = bank.w_out[layer][gid % N_PREC, gid // N_PREC]
        y = _ffn_batched(buf, w_in, w_out, self.cfg.swiglu)[group, rank]
        out = torch.zeros_like(x)
        return out.index_add_(0, tok, y * w.reshape(-1)[order, None])

    def _experts_loop(self, x: torch.Tensor, w: torch.Tensor, exec_: torch.Tensor,
                      prec: torch.Tensor, bank: "ExpertBank | None", layer: int) -> torch.Tensor:
        """One FFN call per (expert, precision) group: fastest when groups are large."""
        N, k = exec_.shape
        key = (exec_ * N_PREC + prec).reshape(-1)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.cfg.experts * N_PREC).tolist()
        tok = order // k
        wflat = w.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for g, n in enumerate(counts):
            if not n:
                continue
            e, c = divmod(g, N_PREC)
            t = tok[start:start + n]
            if bank is None:
                if c:
                    raise ValueError("quantized execution needs an ExpertBank")
                w_in, w_out = self.w_in[e], self.w_out[e]
            else:
                w_in, w_out = bank.w_in[layer][c, e], bank.w_out[layer][c, e]
            y = _ffn(x[t], w_in, w_out, self.cfg.swiglu) * wflat[start:start + n, None]
            out.index_add_(0, t, y)
            start += n
        return out

    def forward(self, h: torch.Tensor, layer: int, plan: Plan | None, bank: "ExpertBank | None"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, d = h.shape
        h = h + self.attn(h)
        x3 = self.norm(h)
        x = x3.reshape(B * T, d)
        k = self.cfg.top_k
        given = plan.idx[:, :, layer].reshape(B * T, k) if plan is not None else None
        idx, w, logits = self.gate(x, given)
        if plan is not None:
            exec_ = plan.exec[:, :, layer].reshape(B * T, k)
            prec = plan.prec[:, :, layer].reshape(B * T, k)
        else:
            exec_, prec = idx, torch.zeros_like(idx)
        out = self.experts(x, w, exec_, prec, bank, layer)
        if self.cfg.shared_d_ff:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * _ffn(
                x, self.shared_in, self.shared_out, swiglu=True)
        # Switch Transformer load-balancing loss: E * sum_e f_e * P_e.
        E = self.cfg.experts
        frac = torch.bincount(idx.reshape(-1), minlength=E).to(x.dtype) / idx.numel()
        aux = E * (frac * torch.softmax(logits, dim=-1).mean(0)).sum()
        return (h + out.view(B, T, d), x3, idx.view(B, T, k), w.view(B, T, k), aux)


class ExpertBank(NamedTuple):
    """Every expert's weights at every precision, per layer ``(N_PREC, E, out, in)``."""

    w_in: list[torch.Tensor]
    w_out: list[torch.Tensor]


class ProxyMoE(nn.Module):
    def __init__(self, cfg: ProxyConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        n_blocks = cfg.n_layers * (2 if cfg.dense_d_ff else 1)
        out_std = cfg.d_model ** -0.5 / (2 * n_blocks) ** 0.5  # residual-branch scaling
        self.embed = _normal((cfg.vocab, cfg.d_model), 1.0, gen)
        self.pos = _normal((cfg.context, cfg.d_model), 0.1, gen)
        self.dense = nn.ModuleList(DenseBlock(cfg, gen, out_std) for _ in range(cfg.n_layers)) \
            if cfg.dense_d_ff else None
        self.moe = nn.ModuleList(MoEBlock(cfg, gen, out_std) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = _normal((cfg.vocab, cfg.d_model), cfg.d_model ** -0.5, gen)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.cfg.context:
            raise ValueError(f"sequence of {T} tokens exceeds the context of {self.cfg.context}")
        return self.embed[tokens] + self.pos[:T]

    def forward(self, tokens: torch.Tensor, plan: Plan | None = None, bank: ExpertBank | None = None,
                keep: bool = False) -> Forward:
        """Logits for ``tokens`` (B, T); ``keep`` also returns every MoE layer's input and output."""
        return self.run(self.embed_tokens(tokens), 0, plan, bank, keep)

    def run(self, h: torch.Tensor, start: int, plan: Plan | None = None,
            bank: ExpertBank | None = None, keep: bool = False) -> Forward:
        """Continue from the residual stream ``h`` entering MoE layer ``start``'s stage.

        ``plan`` still covers all L layers (only layers >= start are read).
        """
        ins, outs, idxs, ws, aux = [], [], [], [], []
        for layer in range(start, self.cfg.n_layers):
            if self.dense is not None:
                h = self.dense[layer](h)
            h, x, idx, w, a = self.moe[layer](h, layer, plan, bank)
            idxs.append(idx)
            ws.append(w)
            aux.append(a)
            if keep:
                ins.append(x)
                outs.append(h)
        logits = F.linear(self.norm(h), self.head)
        stack = (lambda ts: torch.stack(ts, dim=2)) if idxs else (lambda ts: torch.empty(0))
        return Forward(logits, stack(idxs), stack(ws), torch.stack(aux).mean() if aux else
                       torch.zeros(()), ins if keep else None, outs if keep else None)

    def tail(self, h: torch.Tensor, layer: int, plan: Plan, bank: ExpertBank | None = None) -> torch.Tensor:
        """Logits when the residual stream after MoE layer ``layer`` is ``h``."""
        if layer + 1 < self.cfg.n_layers:
            return self.run(h, layer + 1, plan, bank).logits
        return F.linear(self.norm(h), self.head)

    @torch.no_grad()
    def bank(self) -> ExpertBank:
        """Dequantized copies of every expert at every precision (FP16 = the trained weights)."""
        w_in, w_out = [], []
        for blk in self.moe:
            w_in.append(torch.stack([quantize(blk.w_in.detach(), c) for c in Precision]))
            w_out.append(torch.stack([quantize(blk.w_out.detach(), c) for c in Precision]))
        return ExpertBank(w_in, w_out)
