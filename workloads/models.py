"""Catalogue of the three MoE models the paper evaluates, with their real sizes.

Every number below was checked against the model's public Hugging Face
``config.json`` (and the modelling code where the config is silent):

- ``mistralai/Mixtral-8x7B-v0.1``: hidden_size 4096, num_hidden_layers 32,
  num_local_experts 8, num_experts_per_tok 2, intermediate_size 14336 (SwiGLU:
  w1, w3: 4096->14336, w2: 14336->4096, no bias), num_attention_heads 32,
  num_key_value_heads 8, head_dim 128, vocab_size 32000, untied lm_head.
- ``Qwen/Qwen1.5-MoE-A2.7B``: hidden_size 2048, num_hidden_layers 24 (MoE in
  every layer, decoder_sparse_step 1), num_experts 60, num_experts_per_tok 4,
  moe_intermediate_size 1408, shared_expert_intermediate_size 5632 with a
  ``shared_expert_gate`` Linear(2048, 1) passed through a sigmoid,
  num_attention_heads 16 = num_key_value_heads 16 (MHA, head_dim 128), q/k/v
  projections with bias and o_proj without (Qwen2MoeAttention), vocab_size
  151936, untied lm_head.
- ``google/switch-base-8``: T5-base encoder-decoder, num_layers 12 and
  num_decoder_layers 12 with num_sparse_encoder_layers = num_sparse_decoder_layers
  = 6 (encoder/decoder_sparse_step 2: every other block is MoE), d_model 768,
  d_ff 3072, dense_act_fn "relu" (not gated: wi, wo, no bias), num_heads 12,
  d_kv 64, vocab_size 32128, tied embeddings. The same fields were read from
  the switch-base-32/64/256 configs, which differ only in num_experts; 8 comes
  from the checkpoint name and the SwitchTransformersConfig docs.

Sanity check (tests): total parameters come out at 46.7B (Mixtral), 14.3B
(Qwen1.5-MoE, its model card) and 0.62B (Switch-Base-8); active parameters at
12.9B (Mixtral) and 2.7B (Qwen1.5-MoE, the "A2.7B").

Sizes follow the cost model of Section III-D: v(c) per precision, w_E in FLOPs
per token, d_in = d_out the fp16 hidden state, and a per-layer dense part that
every server holds and runs where the token resides.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Mapping

from hetroute.hardware import FfnShape
from hetroute.system import MoEShape, Precision

FP16_BYTES = 2
INT4_GROUP = 128


@dataclass(frozen=True)
class ModelSpec:
    """One MoE model's architecture, per MoE layer where it matters.

    ``n_layers`` counts MoE layers (the L of the paper). The ``*_per_layer``
    fields say how much non-expert work one MoE layer stands for: Switch has a
    dense T5 block between MoE blocks and a cross-attention in decoder blocks,
    averaged here over its 12 MoE layers (6 encoder, 6 decoder).
    """

    name: str
    hf_id: str
    n_layers: int
    experts_per_layer: int
    top_k: int
    d_model: int
    expert_d_ff: int
    expert_matrices: int  # 2 for ReLU (wi, wo), 3 for SwiGLU (gate, up, down)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    shared_expert_d_ff: int = 0  # 0: no shared expert (Qwen: 5632, SwiGLU)
    self_attn_per_layer: float = 1.0
    cross_attn_per_layer: float = 0.0
    dense_ffn_per_layer: float = 0.0  # Switch: the dense T5 block between MoE blocks
    dense_ffn_d_ff: int = 0
    dense_ffn_matrices: int = 2
    norms_per_layer: float = 2.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts_per_layer:
            raise ValueError(f"{self.name}: top_k must be in [1, experts_per_layer]")
        if self.expert_matrices not in (2, 3) or self.dense_ffn_matrices not in (2, 3):
            raise ValueError(f"{self.name}: an FFN has 2 (ReLU) or 3 (SwiGLU) matrices")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: n_heads must be a multiple of n_kv_heads")

    # --- experts -----------------------------------------------------------
    def expert_params(self) -> int:
        """Weights of one routed expert (no biases in any of the three models)."""
        return self.expert_matrices * self.d_model * self.expert_d_ff

    def _expert_out_channels(self) -> int:
        # gate/up (or wi) map d_model -> d_ff; down (or wo) maps d_ff -> d_model.
        return (self.expert_matrices - 1) * self.expert_d_ff + self.d_model

    def _expert_int4_groups(self) -> int:
        up = (self.expert_matrices - 1) * self.expert_d_ff * math.ceil(self.d_model / INT4_GROUP)
        down = self.d_model * math.ceil(self.expert_d_ff / INT4_GROUP)
        return up + down

    def expert_bytes(self, precision: Precision) -> int:
        """v(c): bytes of one expert replica at ``precision``.

        FP16: 2 B/weight. INT8: 1 B/weight plus one fp16 scale per output
        channel (per-channel symmetric). INT4: 0.5 B/weight plus one fp16 scale
        per group of 128 input weights (group-wise symmetric, as in GPTQ/AWQ
        with ``sym=True``); zero points are NOT included, so asymmetric INT4
        would add 0.5 B per group more (~0.4%).
        """
        p = self.expert_params()
        if precision == Precision.FP16:
            return FP16_BYTES * p
        if precision == Precision.INT8:
            return p + FP16_BYTES * self._expert_out_channels()
        if precision == Precision.INT4:
            return p // 2 + FP16_BYTES * self._expert_int4_groups()
        raise ValueError(f"unknown precision {precision!r}")

    def expert_flops(self) -> int:
        """w_E: FLOPs per token through one expert (a multiply-add is 2 FLOPs)."""
        return 2 * self.expert_params()

    def hidden_bytes(self) -> int:
        """d_in = d_out: one token's fp16 hidden state on the wire."""
        return FP16_BYTES * self.d_model

    # --- dense (non-expert) part of one MoE layer ---------------------------
    def _attention_weights(self) -> int:
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        return self.d_model * (q + 2 * kv) + q * self.d_model

    def _attention_biases(self) -> int:
        if not self.qkv_bias:
            return 0
        return self.n_heads * self.head_dim + 2 * self.n_kv_heads * self.head_dim

    def _dense_matmul_weights(self) -> float:
        """Weights a token multiplies by in one MoE layer outside the routed experts."""
        attn = (self.self_attn_per_layer + self.cross_attn_per_layer) * self._attention_weights()
        router = self.d_model * self.experts_per_layer
        shared = 0
        if self.shared_expert_d_ff:
            shared = 3 * self.d_model * self.shared_expert_d_ff + self.d_model  # + sigmoid gate
        ffn = self.dense_ffn_per_layer * self.dense_ffn_matrices * self.d_model * self.dense_ffn_d_ff
        return attn + router + shared + ffn

    def dense_params(self) -> float:
        """Non-expert parameters one MoE layer stands for (matmuls, biases, norms)."""
        biases = self.self_attn_per_layer * self._attention_biases()
        norms = self.norms_per_layer * self.d_model
        return self._dense_matmul_weights() + biases + norms

    def dense_flops(self) -> float:
        """FLOPs per token per MoE layer outside the routed experts.

        2 x the weights of the attention projections (real GQA shapes; Switch's
        cross-attention counted as if its K/V ran on the token too), the router,
        Qwen's shared expert and its gate, and Switch's interleaved dense FFN.
        Ignored: the sequence-length-dependent attention scores and context
        (4 x seq x n_heads x head_dim per token), norms, activations, softmax,
        biases; at the paper's ~36-token requests the score part is below 2%
        of this for all three models.
        """
        return 2.0 * self._dense_matmul_weights()

    def dense_bytes(self) -> int:
        """fp16 bytes of the non-expert weights of one MoE layer (every server holds them)."""
        return int(round(FP16_BYTES * self.dense_params()))

    def total_params(self) -> float:
        """All parameters, embeddings included: the check against published totals."""
        embed = self.vocab_size * self.d_model * (1 if self.tied_embeddings else 2)
        experts = self.experts_per_layer * self.expert_params()
        return self.n_layers * (experts + self.dense_params()) + embed

    def active_params(self) -> float:
        """Parameters one token uses (top_k experts per layer), embeddings included."""
        embed = self.vocab_size * self.d_model * (1 if self.tied_embeddings else 2)
        return self.n_layers * (self.top_k * self.expert_params() + self.dense_params()) + embed

    def kv_bytes_per_token(self) -> int:
        """FP16 K and V one token adds to the cache per MoE layer (its self-attention blocks)."""
        return int(round(self.self_attn_per_layer * 2 * self.n_kv_heads * self.head_dim * FP16_BYTES))

    def attn_flops_per_position(self) -> float:
        """Scores and context per token per attended position: 2 x (QK^T + AV) over all heads."""
        return 4.0 * self.n_heads * self.head_dim * (self.self_attn_per_layer + self.cross_attn_per_layer)

    def dense_kernels(self) -> int:
        """Kernels the dense part of one MoE layer launches: per attention block about eight
        (norm, QKV, rotary, attention, output projection, residual, norm, router), three per
        dense or shared FFN."""
        attn = 8 * (self.self_attn_per_layer + self.cross_attn_per_layer)
        ffn = 3 * (self.dense_ffn_per_layer + (1 if self.shared_expert_d_ff else 0))
        return int(round(attn + ffn))

    def shape(self) -> MoEShape:
        """The cost model's view of this model (``hetroute.system.MoEShape``)."""
        return MoEShape(
            name=self.name,
            n_layers=self.n_layers,
            experts_per_layer=self.experts_per_layer,
            top_k=self.top_k,
            d_model=self.d_model,
            expert_flops=float(self.expert_flops()),
            expert_bytes=types.MappingProxyType({c: self.expert_bytes(c) for c in Precision}),
            hidden_bytes=self.hidden_bytes(),
            dense_flops=self.dense_flops(),
            dense_bytes=self.dense_bytes(),
            expert_ffn=FfnShape(self.d_model, self.expert_d_ff, gated=self.expert_matrices == 3),
            kv_bytes_per_token=self.kv_bytes_per_token(),
            attn_flops_per_position=self.attn_flops_per_position(),
            dense_kernels=self.dense_kernels(),
        )


SWITCH_BASE_8 = ModelSpec(
    name="switch-base-8", hf_id="google/switch-base-8",
    n_layers=12, experts_per_layer=8, top_k=1, d_model=768,
    expert_d_ff=3072, expert_matrices=2,
    n_heads=12, n_kv_heads=12, head_dim=64,
    vocab_size=32128, tied_embeddings=True,
    # Per MoE layer: 2 T5 blocks (the MoE one and the dense one before it), each
    # with self-attention; decoder blocks add cross-attention (12 over 12 layers).
    self_attn_per_layer=2.0, cross_attn_per_layer=1.0,
    dense_ffn_per_layer=1.0, dense_ffn_d_ff=3072, dense_ffn_matrices=2,
    norms_per_layer=5.0,
)

QWEN15_MOE_A27B = ModelSpec(
    name="qwen1.5-moe-a2.7b", hf_id="Qwen/Qwen1.5-MoE-A2.7B",
    n_layers=24, experts_per_layer=60, top_k=4, d_model=2048,
    expert_d_ff=1408, expert_matrices=3,
    n_heads=16, n_kv_heads=16, head_dim=128,
    vocab_size=151936, tied_embeddings=False, qkv_bias=True,
    shared_expert_d_ff=5632,
)

MIXTRAL_8X7B = ModelSpec(
    name="mixtral-8x7b", hf_id="mistralai/Mixtral-8x7B-v0.1",
    n_layers=32, experts_per_layer=8, top_k=2, d_model=4096,
    expert_d_ff=14336, expert_matrices=3,
    n_heads=32, n_kv_heads=8, head_dim=128,
    vocab_size=32000, tied_embeddings=False,
)

MODELS: Mapping[str, ModelSpec] = types.MappingProxyType(
    {m.name: m for m in (SWITCH_BASE_8, QWEN15_MOE_A27B, MIXTRAL_8X7B)})

ALIASES: Mapping[str, str] = types.MappingProxyType(
    {"switch": "switch-base-8", "qwen": "qwen1.5-moe-a2.7b", "mixtral": "mixtral-8x7b"})


def get_model(name: str) -> ModelSpec:
    """The catalogue entry for a name or alias (case-insensitive)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    try:
        return MODELS[key]
    except KeyError:
        valid = ", ".join([*MODELS, *ALIASES])
        raise KeyError(f"unknown model {name!r}; valid names: {valid}") from None
