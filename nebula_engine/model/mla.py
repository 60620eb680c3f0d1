"""Multi-head latent attention (DeepSeek-V2) over a latent KV cache.

Legend: T = tokens, Hd = hidden size, H = heads, R = kv_lora_rank (latent width), Dn = qk_nope_head_dim,
Dr = qk_rope_head_dim, Dv = v_head_dim, D = Dn + Dr.

Per token the layer produces a latent ``c̃`` [R] and one rotated ``k_pe`` [Dr] shared by all heads
(``latent``): those R + Dr values are all the cache keeps (``kv_cache_spec``). Attention itself — decompress
for prefill, absorb ``kv_b_proj`` into query and output for decode — is the MLA backend's job
(``kernels.mla_attention``), reached through ``AttentionContext.attend_latent``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
from torch import nn

from nebula_engine.kernels.attention import AttentionContext
from nebula_engine.kernels.cpu_linear import Linear
from nebula_engine.kernels.mla_attention import MLAParams
from nebula_engine.kvcache.spec import MLALatentSpec
from nebula_engine.model.config import ModelConfig, RopeConfig
from nebula_engine.model.layers import RMSNorm
from nebula_engine.model.rotary import RotaryEmbedding


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None  # None (V2-Lite): q = q_proj(x); else q = q_b_proj(norm(q_a_proj(x)))
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> MLAConfig:
        return cls(num_heads=raw["num_attention_heads"], q_lora_rank=raw.get("q_lora_rank"),
                   kv_lora_rank=raw["kv_lora_rank"], qk_nope_head_dim=raw["qk_nope_head_dim"],
                   qk_rope_head_dim=raw["qk_rope_head_dim"], v_head_dim=raw["v_head_dim"])


def mla_softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """``D^-0.5``, times ``m²`` with ``m = 0.1·mscale_all_dim·ln(factor) + 1`` under YaRN with mscale_all_dim.

    DeepSeek's YaRN puts the attention-temperature correction in the softmax scale rather than in cos/sin
    (whose factor is mscale/mscale_all_dim, 1 for V2). transformers 5.24 (``yarn_apply_mscale``) and the
    original DeepSeek code both include m².
    """
    scale = qk_head_dim**-0.5
    scaling = rope.scaling
    if scaling is not None and scaling.type == "yarn" and scaling.mscale_all_dim and scaling.factor > 1:
        m = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    """Parameter names follow transformers' ``DeepseekV2Attention``."""

    def __init__(self, config: ModelConfig, attn_layer_idx: int):
        super().__init__()
        mla = self.mla = MLAConfig.from_hf(config.hf_config)
        self.attn_layer_idx = attn_layer_idx
        hidden, bias, eps = config.hidden_size, config.attention_bias, config.rms_norm_eps
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, mla.num_heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps)
            self.q_b_proj = Linear(mla.q_lora_rank, mla.num_heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps)
        self.kv_b_proj = Linear(mla.kv_lora_rank, mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                   bias=False)
        self.o_proj = Linear(mla.num_heads * mla.v_head_dim, hidden, bias=bias)
        rope = replace(config.rope, style="interleaved", rotary_dim=mla.qk_rope_head_dim)
        self.rotary = RotaryEmbedding(rope)
        self.scale = mla_softmax_scale(mla.qk_head_dim, rope)

    def query(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hd] -> q_nope [T, H, Dn], rotated q_pe [T, H, Dr]."""
        q_nope, q_pe = self._query_unrotated(x)
        return q_nope, self.rotary(positions, q_pe)

    def latent(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hd] -> normed latent c̃ [T, R], rotated k_pe [T, Dr]: the R + Dr values a latent cache keeps."""
        latent, k_pe = self._latent_unrotated(x)
        return latent, self.rotary(positions, k_pe[:, None, :])[:, 0]

    def _query_unrotated(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mla = self.mla
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], mla.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)

    def _latent_unrotated(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.mla.kv_lora_rank, self.mla.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(c), k_pe

    def decompress(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c̃ [T, R], k_pe [T, Dr] -> K [T, H, D] (= [k_nope_h; k_pe]), V [T, H, Dv]."""
        mla = self.mla
        kv = self.kv_b_proj(latent).view(latent.shape[0], mla.num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, mla.num_heads, -1)], dim=-1)
        return k, v

    @property
    def latent_rope_dim(self) -> int:
        """Dr: a cached latent row is [c̃ (R) | rotated k_pe (Dr)], RoPE in its last Dr columns only."""
        return self.mla.qk_rope_head_dim

    def kv_cache_spec(self, dtype: torch.dtype) -> MLALatentSpec:
        return MLALatentSpec(self.mla.kv_lora_rank, self.mla.qk_rope_head_dim, dtype)

    def attention_params(self) -> MLAParams:
        mla = self.mla
        kv_b = self.kv_b_proj.weight.view(mla.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return MLAParams(kv_b, mla.qk_nope_head_dim, self.scale)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn_ctx: AttentionContext) -> torch.Tensor:
        q_nope, q_pe = self._query_unrotated(x)
        latent, k_pe = self._latent_unrotated(x)
        # = query() and latent(): a token's q_pe heads and k_pe share its rotation, so one rotary call does both
        rotated = self.rotary(positions, torch.cat([q_pe, k_pe[:, None, :]], dim=1))  # [T, H + 1, Dr]
        out = attn_ctx.attend_latent(self.attn_layer_idx, q_nope, rotated[:, :-1], latent, rotated[:, -1],
                                     self.attention_params())
        return self.o_proj(out.flatten(1))  # out [T, H, Dv]
