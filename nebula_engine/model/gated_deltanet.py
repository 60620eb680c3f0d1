"""Gated DeltaNet linear-attention layer (Qwen3.5) with carried state: one sequence, or a batch's decode tokens.

Legend: T = tokens of one sequence, B = sequences, Hd = hidden size, Hk / Hv = key / value heads,
dk / dv = their head dims, C = conv channels (2·Hk·dk + Hv·dv: q, k, v), K = conv kernel width.

Per sequence the layer's whole memory of the past is ``LinearAttentionState``: the last K-1 conv inputs
and the recurrent state [Hv, dk, dv]. ``forward(x, state)`` continues from ``state`` (None = empty
context) and returns the state after x, so prefill(a + b) == prefill(a) then prefill(b, state).
``decode(x, conv, recurrent)`` advances B sequences by one token each, their states stacked: one call per
layer and decode step whatever B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from nebula_engine.kernels.cpu_linear import Linear
from nebula_engine.kernels.gated_delta_rule import (chunk_gated_delta_rule, gated_delta_step,
                                                   recurrent_gated_delta_rule)
from nebula_engine.kernels.pic_ops import gated_delta_transition
from nebula_engine.kvcache.spec import LinearStateSpec


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> GatedDeltaNetConfig:
        return cls(hidden_size=raw["hidden_size"], num_k_heads=raw["linear_num_key_heads"],
                   num_v_heads=raw["linear_num_value_heads"], head_k_dim=raw["linear_key_head_dim"],
                   head_v_dim=raw["linear_value_head_dim"], conv_kernel=raw["linear_conv_kernel_dim"],
                   eps=raw.get("rms_norm_eps", 1e-6))

    def state_spec(self, dtype: torch.dtype) -> LinearStateSpec:
        """The engine's per-sequence slot for one layer's ``LinearAttentionState``."""
        return LinearStateSpec(self.conv_channels, self.conv_kernel - 1, self.num_v_heads, self.head_k_dim,
                               self.head_v_dim, dtype)


@dataclass(frozen=True)
class LinearAttentionState:
    """One sequence's state in one linear-attention layer; constant size whatever the context length."""

    conv: torch.Tensor  # [C, K-1] the last K-1 conv inputs (zeros before the sequence start)
    recurrent: torch.Tensor  # [Hv, dk, dv] fp32


class GatedRMSNorm(nn.Module):
    """``rmsnorm(o) * w * silu(z)`` per value head; ``w`` starts at 1 (not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # eps as in FLA / transformers


class GatedDeltaNet(nn.Module):
    """Parameter names follow transformers' ``Qwen3_5GatedDeltaNet``."""

    def __init__(self, cfg: GatedDeltaNetConfig, linear_layer_idx: int, chunk_size: int = 64):
        super().__init__()
        self.cfg, self.linear_layer_idx, self.chunk_size = cfg, linear_layer_idx, chunk_size
        value_dim = cfg.num_v_heads * cfg.head_v_dim
        self.in_proj_qkv = Linear(cfg.hidden_size, cfg.conv_channels, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, value_dim, bias=False)
        self.in_proj_b = Linear(cfg.hidden_size, cfg.num_v_heads, bias=False)
        self.in_proj_a = Linear(cfg.hidden_size, cfg.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_channels, cfg.conv_channels, cfg.conv_kernel, groups=cfg.conv_channels,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_v_heads))
        self.norm = GatedRMSNorm(cfg.head_v_dim, cfg.eps)
        self.out_proj = Linear(value_dim, cfg.hidden_size, bias=False)

    def empty_state(self, dtype: torch.dtype | None = None) -> LinearAttentionState:
        cfg, weight = self.cfg, self.conv1d.weight
        return LinearAttentionState(
            conv=torch.zeros(cfg.conv_channels, cfg.conv_kernel - 1, dtype=dtype or weight.dtype, device=weight.device),
            recurrent=torch.zeros(cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, device=weight.device))

    def _conv(self, qkv: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU over qkv [T, C] after the K-1 inputs in conv_state [C, K-1]."""
        window = torch.cat([conv_state, qkv.t()], dim=1)  # [C, K-1+T]
        out = F.conv1d(window[None], self.conv1d.weight, groups=self.cfg.conv_channels)[0]  # [C, T]
        return F.silu(out.t()), window[:, window.shape[1] - (self.cfg.conv_kernel - 1):]

    def _project(self, x: torch.Tensor, conv_state: torch.Tensor):
        """x [T, Hd] after conv inputs conv_state -> q, k [T, Hv, dk], v [T, Hv, dv], g, beta [T, Hv], new conv state."""
        qkv, conv_state = self._conv(self.in_proj_qkv(x), conv_state)
        return *self._heads(x, qkv), conv_state

    def _heads(self, x: torch.Tensor, qkv: torch.Tensor):
        """Rows x [N, Hd] and their conv outputs qkv [N, C] -> q, k [N, Hv, dk], v [N, Hv, dv], g, beta [N, Hv].

        Row-wise: N is a sequence's tokens or a decode batch's sequences alike."""
        cfg, tokens = self.cfg, x.shape[0]
        key_dim = cfg.num_k_heads * cfg.head_k_dim
        q, k, v = qkv.split([key_dim, key_dim, cfg.num_v_heads * cfg.head_v_dim], dim=-1)
        group = cfg.num_v_heads // cfg.num_k_heads  # each k-head serves `group` consecutive v-heads
        q = _l2norm(q.float().view(tokens, cfg.num_k_heads, cfg.head_k_dim)) * cfg.head_k_dim**-0.5
        k = _l2norm(k.float().view(tokens, cfg.num_k_heads, cfg.head_k_dim))
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)  # [T, Hv, dk]
        v = v.view(tokens, cfg.num_v_heads, cfg.head_v_dim)  # [T, Hv, dv]
        beta = torch.sigmoid(self.in_proj_b(x)).float()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())  # log-decay
        return q, k, v, g, beta

    def forward(self, x: torch.Tensor, state: LinearAttentionState | None = None
                ) -> tuple[torch.Tensor, LinearAttentionState]:
        """x [T, Hd] of one sequence -> (out [T, Hd], state after x)."""
        cfg, tokens = self.cfg, x.shape[0]
        if state is None:
            state = self.empty_state(x.dtype)
        q, k, v, g, beta, conv_state = self._project(x, state.conv)
        kernel = recurrent_gated_delta_rule if tokens == 1 else self._chunked
        out, recurrent = kernel(q, k, v, g, beta, state.recurrent)  # out [T, Hv, dv]
        z = self.in_proj_z(x).view(tokens, cfg.num_v_heads, cfg.head_v_dim)
        out = self.norm(out.to(x.dtype), z).flatten(1)  # [T, Hv*dv]
        return self.out_proj(out), LinearAttentionState(conv_state, recurrent)

    def decode(self, x: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row b of x [B, Hd] is sequence b's next token, its states conv [B, C, K-1], recurrent [B, Hv, dk, dv]
        -> (out [B, Hd], new conv, new recurrent); equals ``forward`` per sequence."""
        cfg = self.cfg
        window = torch.cat([conv, self.in_proj_qkv(x).to(conv.dtype)[:, :, None]], dim=2)  # [B, C, K]
        qkv = F.silu((window * self.conv1d.weight[:, 0]).sum(-1))  # the causal conv's last output: [B, C]
        q, k, v, g, beta = self._heads(x, qkv.to(x.dtype))
        out, recurrent = gated_delta_step(q, k, v, g, beta, recurrent)  # out [B, Hv, dv]
        z = self.in_proj_z(x).view(x.shape[0], cfg.num_v_heads, cfg.head_v_dim)
        return self.out_proj(self.norm(out.to(x.dtype), z).flatten(1)), window[:, :, 1:], recurrent

    def transition(self, x: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The affine map x [T, Hd] applies to the recurrent state: ``S -> M S + N`` (HYPIC, spec B4).

        M [Hv, dk, dk] is the product of the per-token transitions, N [Hv, dk, dv] the state reached from zero;
        ``conv_state`` is the conv input before x. Running x from any S equals ``M @ S + N``.
        """
        q, k, v, g, beta, _ = self._project(x, conv_state)
        _, n = self._chunked(q, k, v, g, beta, None)
        return gated_delta_transition(k, g, beta, self.chunk_size), n

    def _chunked(self, q, k, v, g, beta, initial_state):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state, chunk_size=self.chunk_size)
