"""DeepSeek-V2 / V2-Lite (``model_type: deepseek_v2``): MLA attention, DeepSeekMoE after the first dense layers.

Legend: T = tokens, Hd = hidden size, E = routed experts, G = expert groups, k = experts per token.
Layer i uses a dense SwiGLU iff ``i < first_k_dense_replace``; otherwise routed experts (softmax router,
greedy or group-limited top-k, weights × routed_scaling_factor, no renormalisation) plus ungated shared
experts. As in transformers 5.24 the routing ignores ``norm_topk_prob`` (false in the released configs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from nebula_engine.kernels.cpu_linear import Linear
from nebula_engine.kvcache.spec import KVCacheGroupSpec
from nebula_engine.model.base import CausalLM
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.layers import DecoderLayer, GatedMLP, StackedExperts
from nebula_engine.model.mla import MLAttention

logger = logging.getLogger(__name__)

_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepseekMoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int
    topk_method: str
    num_groups: int | None
    topk_groups: int | None
    routed_scaling_factor: float
    first_k_dense_replace: int

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> DeepseekMoEConfig:
        method = raw.get("topk_method") or "greedy"
        if method not in _TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {method!r}; supported: {', '.join(_TOPK_METHODS)}")
        if raw.get("scoring_func", "softmax") != "softmax":
            raise ValueError(f"unsupported scoring_func {raw['scoring_func']!r}; DeepSeek-V2 routes by softmax")
        if raw.get("norm_topk_prob"):
            logger.warning("norm_topk_prob=true is ignored, as transformers' DeepSeek-V2 does")
        return cls(num_experts=raw["n_routed_experts"], top_k=raw["num_experts_per_tok"],
                   intermediate_size=raw["moe_intermediate_size"], num_shared_experts=raw.get("n_shared_experts") or 0,
                   topk_method=method, num_groups=raw.get("n_group"), topk_groups=raw.get("topk_group"),
                   routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                   first_k_dense_replace=raw.get("first_k_dense_replace") or 0)


def keep_top_groups(scores: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """scores [T, E] with every expert outside the ``topk_groups`` best groups (by max score) zeroed."""
    grouped = scores.view(scores.shape[0], num_groups, -1)  # [T, G, E/G]
    best_groups = grouped.amax(dim=-1).topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, best_groups, True)
    return grouped.masked_fill(~keep[..., None], 0.0).view_as(scores)


class DeepseekMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: DeepseekMoEConfig):
        super().__init__()
        self.moe = moe
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = StackedExperts(moe.num_experts, hidden_size, moe.intermediate_size)
        if moe.num_shared_experts:
            self.shared_experts = GatedMLP(hidden_size, moe.intermediate_size * moe.num_shared_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hd] -> expert ids, weights [T, k]; the router runs in fp32 whatever the model dtype."""
        moe = self.moe
        scores = F.linear(x.float(), self.gate.weight.float()).softmax(dim=-1)  # [T, E]
        if moe.topk_method == "group_limited_greedy":
            scores = keep_top_groups(scores, moe.num_groups, moe.topk_groups)
        weights, expert_ids = scores.topk(moe.top_k, dim=-1)
        return expert_ids, (weights * moe.routed_scaling_factor).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.route(x))
        return out + self.shared_experts(x) if self.moe.num_shared_experts else out


class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        self.moe_config = DeepseekMoEConfig.from_hf(config.hf_config)
        super().__init__(config)

    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        if layer_idx < self.moe_config.first_k_dense_replace:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        else:
            mlp = DeepseekMoE(c.hidden_size, self.moe_config)
        return DecoderLayer(MLAttention(c, attn_layer_idx=layer_idx), mlp, c.hidden_size, c.rms_norm_eps)

    def attention_layers(self) -> list[MLAttention]:
        layers = [m for m in self.modules() if isinstance(m, MLAttention)]
        return sorted(layers, key=lambda m: m.attn_layer_idx)

    def kv_cache_groups(self, dtype: torch.dtype) -> list[KVCacheGroupSpec]:
        """One latent group: every layer caches c̃ + k_pe (R + Dr values per token)."""
        layers = self.attention_layers()
        return [KVCacheGroupSpec(tuple(range(len(layers))), layers[0].kv_cache_spec(dtype))]
