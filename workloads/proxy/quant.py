"""Weight-only fake quantization of expert matrices (dequantized back to float).

Both schemes are symmetric absmax, as the cost model's replica sizes assume
(``workloads.models.ModelSpec.expert_bytes``):

- INT8 per output channel: one scale per row of W (out x in), levels -127..127.
- INT4 group-wise along the input dimension, groups of ``min(128, fan_in)``
  weights, levels -7..7. Group 128 is what GPTQ/AWQ/llama.cpp use on the real
  models; a proxy expert's fan-in is often below 128 (d_model 64), so a row is
  then a single group, which is as close to "groups of 128" as the matrix allows.
"""

from __future__ import annotations

import torch

from hetroute.system import Precision

INT4_GROUP = 128


def _absmax_round(w: torch.Tensor, levels: int) -> torch.Tensor:
    """Round each row of ``w`` (..., n) to ``levels`` steps either side of zero."""
    scale = w.abs().amax(dim=-1, keepdim=True) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(w / scale), -levels, levels) * scale


def int4_group(fan_in: int) -> int:
    """The INT4 group size of a matrix with ``fan_in`` inputs."""
    return min(INT4_GROUP, fan_in)


def quantize(w: torch.Tensor, precision: Precision) -> torch.Tensor:
    """``w`` (..., out, in) as the dequantized weights of a replica at ``precision``."""
    if precision == Precision.FP16:
        return w.clone()
    if precision == Precision.INT8:
        return _absmax_round(w, 127)
    if precision == Precision.INT4:
        fan_in = w.shape[-1]
        g = int4_group(fan_in)
        pad = (-fan_in) % g
        wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
        grouped = wp.reshape(*wp.shape[:-1], wp.shape[-1] // g, g)
        return _absmax_round(grouped, 7).reshape(wp.shape)[..., :fan_in]
    raise ValueError(f"unknown precision {precision!r}")
