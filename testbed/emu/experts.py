"""Scaled-down expert kernels with real quantized weights.

The emulator's compute must be real (so quantization changes outputs and the
quality engineer can measure it) but small (a 2-core host runs a whole
cluster), while the *time* a job takes is the cost model's, enforced by the
stream's padding. So an expert is a SwiGLU FFN (ReLU for Switch) with a small
hidden size, weights drawn deterministically from (seed, expert id), stored at
the replica's precision:

- FP16: half-precision weights;
- INT8: symmetric per-output-channel, float32 scales;
- INT4: symmetric, groups of ``group_size`` along the input dim, two 4-bit
  values per byte (low nibble = even column), fp16 scales per group.

Dequantized compute weights are materialized once per replica: on CPU in
float32 (CPU half matmuls are slow and not what a GPU does), on CUDA in fp16.
The numbers equal dequantize-then-matmul on every call; only the per-call
dequantization time is left out, which the modeled service time replaces anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from hetroute.deployment import Replica
from hetroute.system import Precision

Activation = Literal["swiglu", "relu"]


@dataclass(frozen=True)
class ExpertSpec:
    """Shape and seed of the scaled-down experts of one model."""

    d_model: int = 128
    d_ff: int = 384
    activation: Activation = "swiglu"
    seed: int = 0
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.d_model < 1 or self.d_ff < 1:
            raise ValueError("d_model and d_ff must be positive")
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError("group_size must be an even number >= 2")
        if self.activation not in ("swiglu", "relu"):
            raise ValueError(f"unknown activation {self.activation!r}")

    @property
    def weight_names(self) -> tuple[str, ...]:
        return ("w1", "w3", "w2") if self.activation == "swiglu" else ("w1", "w2")

    def weight_shape(self, name: str) -> tuple[int, int]:
        """(out, in) as in ``torch.nn.Linear``."""
        return (self.d_model, self.d_ff) if name == "w2" else (self.d_ff, self.d_model)



def expert_weights(spec: ExpertSpec, expert: int) -> dict[str, torch.Tensor]:
    """float32 master weights of ``expert``, a pure function of (spec.seed, expert).

    A numpy SeedSequence mixes the pair, so neighbouring ids get unrelated streams.
    """
    state = np.random.SeedSequence([spec.seed, expert]).generate_state(2, dtype=np.uint32)
    gen = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    out = {}
    for name in spec.weight_names:
        o, i = spec.weight_shape(name)
        out[name] = torch.randn(o, i, generator=gen, dtype=torch.float32) / i ** 0.5
    return out


# -- quantization --------------------------------------------------------------

@dataclass(frozen=True)
class QuantizedWeight:
    """One (out, in) matrix at a precision: ``data`` plus scales (None for FP16)."""

    precision: Precision
    data: torch.Tensor  # fp16 | int8 (out, in) | uint8 packed (out, n_groups * group / 2)
    scales: torch.Tensor | None  # INT8: fp32 (out, 1); INT4: fp16 (out, n_groups)
    shape: tuple[int, int]
    group_size: int = 128

    @property
    def nbytes(self) -> int:
        s = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + s


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], last dim even -> uint8, two per byte (low nibble first)."""
    if q.shape[-1] % 2:
        raise ValueError("last dim must be even to pack pairs")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 (..., n) -> int8 (..., 2n) in [-8, 7]."""
    lo = (p & 0x0F).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def quantize(w: torch.Tensor, precision: Precision, group_size: int = 128) -> QuantizedWeight:
    """Quantize a float (out, in) matrix; the input dim is zero-padded to whole INT4 groups."""
    w = w.detach().to(torch.float32).cpu()
    o, i = w.shape
    if precision == Precision.FP16:
        return QuantizedWeight(precision, w.half(), None, (o, i), group_size)
    if precision == Precision.INT8:
        scale = w.abs().amax(dim=1, keepdim=True) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
        return QuantizedWeight(precision, q, scale, (o, i), group_size)
    if precision == Precision.INT4:
        ng = -(-i // group_size)
        wp = torch.zeros(o, ng * group_size)
        wp[:, :i] = w
        g = wp.view(o, ng, group_size)
        scale = (g.abs().amax(dim=2) / 7.0).half()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero group
        q = torch.clamp(torch.round(g / scale.float().unsqueeze(2)), -8, 7).to(torch.int8)
        return QuantizedWeight(precision, pack_int4(q.view(o, -1)), scale, (o, i), group_size)
    raise ValueError(f"unsupported precision {precision!r}")


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (out, in) matrix the replica effectively computes with."""
    o, i = qw.shape
    if qw.precision == Precision.FP16:
        w = qw.data.float()
    elif qw.precision == Precision.INT8:
        assert qw.scales is not None
        w = qw.data.float() * qw.scales
    else:
        assert qw.scales is not None
        q = unpack_int4(qw.data).float().view(o, -1, qw.group_size)
        w = (q * qw.scales.float().unsqueeze(2)).view(o, -1)[:, :i]
    return w.to(dtype).contiguous()


def ffn(weights: Mapping[str, torch.Tensor], x: torch.Tensor, activation: Activation) -> torch.Tensor:
    """SwiGLU: w2(silu(w1 x) * w3 x); ReLU (Switch): w2(relu(w1 x))."""
    h = F.linear(x, weights["w1"])
    if activation == "swiglu":
        h = F.silu(h).mul_(F.linear(x, weights["w3"]))
    else:
        h = h.relu_()
    return F.linear(h, weights["w2"])


# -- a server's replicas --------------------------------------------------------

def default_device() -> torch.device:
    """CUDA where it exists; decided once at worker start-up."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ExpertBank:
    """The replicas one server hosts, each at its own precision, ready to run batched.

    ``replicas`` maps the deployment's replica index to its ``Replica``.
    ``state_dicts`` optionally supplies trained float weights per expert id
    (keys as ``spec.weight_names``); other experts use ``expert_weights``.
    """

    def __init__(self, spec: ExpertSpec, replicas: Mapping[int, Replica],
                 device: torch.device | str | None = None,
                 state_dicts: Mapping[int, Mapping[str, torch.Tensor]] | None = None) -> None:
        self.spec = spec
        self.device = torch.device(device) if device is not None else default_device()
        self.compute_dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.replicas = dict(replicas)
        self.quantized: dict[int, dict[str, QuantizedWeight]] = {}
        self._compute: dict[int, dict[str, torch.Tensor]] = {}
        masters: dict[int, dict[str, torch.Tensor]] = {}
        for rid, rep in self.replicas.items():
            if rep.expert not in masters:
                masters[rep.expert] = self._master(rep.expert, state_dicts)
            qws = {k: quantize(w, rep.precision, spec.group_size)
                   for k, w in masters[rep.expert].items()}
            self.quantized[rid] = qws
            self._compute[rid] = {k: dequantize(q, self.compute_dtype).to(self.device)
                                  for k, q in qws.items()}

    def _master(self, expert: int, state_dicts: Mapping[int, Mapping[str, torch.Tensor]] | None
                ) -> dict[str, torch.Tensor]:
        if state_dicts is None or expert not in state_dicts:
            return expert_weights(self.spec, expert)
        sd = state_dicts[expert]
        out = {}
        for name in self.spec.weight_names:
            if name not in sd:
                raise ValueError(f"state dict of expert {expert} lacks {name!r}")
            w = sd[name]
            if tuple(w.shape) != self.spec.weight_shape(name):
                raise ValueError(f"expert {expert} {name}: shape {tuple(w.shape)}, "
                                 f"expected {self.spec.weight_shape(name)}")
            out[name] = w.detach().float().cpu()
        return out

    def __contains__(self, replica_id: int) -> bool:
        return replica_id in self.replicas

    def nbytes(self, replica_id: int) -> int:
        """Bytes of the replica's stored (quantized) weights."""
        return sum(q.nbytes for q in self.quantized[replica_id].values())

    @torch.inference_mode()
    def run(self, replica_id: int, hidden: torch.Tensor) -> torch.Tensor:
        """[B, d] -> [B, d] on the bank's device, in the dtype of ``hidden``.

        Raises KeyError for a replica this server does not host.
        """
        w = self._compute[replica_id]
        if hidden.dim() != 2 or hidden.shape[1] != self.spec.d_model:
            raise ValueError(f"hidden must be [B, {self.spec.d_model}], got {tuple(hidden.shape)}")
        x = hidden.to(device=self.device, dtype=self.compute_dtype)
        return ffn(w, x, self.spec.activation).to(hidden.dtype)


class ProxyBank:
    """A server's replicas as the trained proxy's experts (``quality.inrun``).

    Same interface as ``ExpertBank``; the weights are the proxy's at the
    replica's precision as the quality profile measured them (the proxy's
    fake quantisation), so what a worker computes is what the profile and the
    replay assume. ``stepper`` is a ``workloads.proxy.inrun.ProxyStepper``.
    """

    def __init__(self, stepper, replicas: Mapping[int, Replica], experts_per_layer: int) -> None:
        self.stepper = stepper
        self.replicas = dict(replicas)
        self.E = experts_per_layer

    def __contains__(self, replica_id: int) -> bool:
        return replica_id in self.replicas

    def run(self, replica_id: int, hidden: torch.Tensor) -> torch.Tensor:
        rep = self.replicas[replica_id]
        layer, expert = divmod(rep.expert, self.E)
        return self.stepper.expert(layer, expert, int(rep.precision), hidden)
