"""Qwen3.5 text models (``qwen3_5[_text]``, ``qwen3_5_moe[_text]``): Gated DeltaNet layers among gated attention.

Legend: T = tokens in the flattened batch, Hd = hidden size, B = sequences, L = linear-attention layers.
``layer_types[i]`` picks layer i's mixer: ``linear_attention`` (GatedDeltaNet, per-sequence state) or
``full_attention`` (RoPE on the leading quarter of each head, zero-centred QK-norms, sigmoid output gate).
Every other norm is zero-centred. Attention layers index the engine's KV caches by their rank among the
full-attention layers; linear layers by their rank among the linear ones (``states[l][b]``).
Checkpoints of the vision-language wrapper keep the text model under ``model.language_model.``; its
vision tower (``model.visual.``) and multi-token-prediction head (``mtp.``) are not loaded.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence, TypeVar

import torch
from torch import nn

from nebula_engine.kernels.attention import AttentionContext, AttentionMetadata
from nebula_engine.kvcache.spec import KVCacheGroupSpec
from nebula_engine.model.base import CausalLM, LayerRows
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, LinearAttentionState
from nebula_engine.model.layers import GatedMLP, RMSNorm, RopeAttention, SharedExpertMoE

LINEAR, FULL = "linear_attention", "full_attention"
LinearStates = Sequence[Sequence[LinearAttentionState | None]]  # [L][B]
_VL_PREFIX, _TEXT_PREFIX = "model.language_model.", "model."
Extra = TypeVar("Extra")  # what a caller's linear mixer returns besides its output
LinearMixer = Callable[[GatedDeltaNet, torch.Tensor], tuple[torch.Tensor, Extra]]  # (linear_attn, normed) -> ...


def layer_types(raw: dict, num_layers: int) -> list[str]:
    """``layer_types`` from config.json, else every ``full_attention_interval``-th layer (default 4) is full."""
    interval = raw.get("full_attention_interval") or 4
    types = list(raw.get("layer_types") or [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)])
    if len(types) != num_layers or set(types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types must list {num_layers} of {LINEAR!r} / {FULL!r}, got {types}")
    return types


class HybridDecoderLayer(nn.Module):
    """Pre-norm block whose mixer is ``linear_attn`` (with per-sequence state) or ``self_attn``."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, zero_centered=True)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_ctx: AttentionContext,
                states: Sequence[LinearAttentionState | None] | None = None
                ) -> tuple[torch.Tensor, list[LinearAttentionState] | None]:
        """hidden [T, Hd]; states [B] (linear layers only) -> (hidden [T, Hd], new states [B] or None)."""
        normed = self.input_layernorm(hidden)
        if self.is_linear:
            mixed, new_states = self._linear(normed, attn_ctx.meta.query_start_loc, states)
        else:
            mixed, new_states = self.self_attn(positions, normed, attn_ctx), None
        return self._add_mlp(hidden + mixed), new_states

    def forward_linear(self, hidden: torch.Tensor, mix: LinearMixer[Extra]) -> tuple[torch.Tensor, Extra]:
        """This linear-attention block with ``mix(linear_attn, normed) -> (mixed [T, Hd], extra)`` as its token
        mixer, for a caller that carries the recurrent state its own way (HYPIC); returns (hidden [T, Hd], extra)."""
        mixed, extra = mix(self.linear_attn, self.input_layernorm(hidden))
        return self._add_mlp(hidden + mixed), extra

    def _add_mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def _linear(self, x, starts, states):
        """Sequences with one new token (decode) in one batched call; prefill chunks one sequence at a time."""
        num_seqs = len(starts) - 1
        decoding = [b for b in range(num_seqs) if starts[b + 1] - starts[b] == 1]
        if len(decoding) == num_seqs:  # a pure decode batch: row b is sequence b
            return self._decode(x, states, decoding)
        out, new_states = torch.empty_like(x), [None] * num_seqs
        if decoding:
            rows = torch.tensor([starts[b] for b in decoding], device=x.device)
            out[rows], decoded = self._decode(x[rows], states, decoding)
            for b, state in zip(decoding, decoded):
                new_states[b] = state
        for b in set(range(num_seqs)) - set(decoding):
            out[starts[b]:starts[b + 1]], new_states[b] = self.linear_attn(x[starts[b]:starts[b + 1]],
                                                                           states[b] if states else None)
        return out, new_states

    def _decode(self, x, states, decoding):
        """x [len(decoding), Hd]: the one new token of each sequence in ``decoding``, continuing its state."""
        empty = None
        conv, recurrent = [], []
        for b in decoding:
            state = states[b] if states else None
            if state is None:  # a one-token prompt
                state = empty = empty or self.linear_attn.empty_state(x.dtype)
            conv.append(state.conv)
            recurrent.append(state.recurrent)
        out, conv, recurrent = self.linear_attn.decode(x, torch.stack(conv), torch.stack(recurrent))
        return out, [LinearAttentionState(c, r) for c, r in zip(conv.unbind(), recurrent.unbind())]


class Qwen3_5ForCausalLM(CausalLM):
    """Its layers return (hidden, new states), so ``run_layers`` always runs them through a hook: the one in
    ``forward_with_states``, or HYPIC's."""

    ignored_weights = CausalLM.ignored_weights + (r"^model\.visual\.", r"^mtp\.")

    def __init__(self, config: ModelConfig):
        self.layer_types = layer_types(config.hf_config, config.num_hidden_layers)
        self.linear_config = GatedDeltaNetConfig.from_hf(config.hf_config)
        super().__init__(config)
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)

    def make_layer(self, layer_idx: int) -> nn.Module:
        c, kind = self.config, self.layer_types[layer_idx]
        rank = self.layer_types[:layer_idx].count(kind)  # index among layers of the same kind
        if kind == LINEAR:
            mixer = GatedDeltaNet(self.linear_config, linear_layer_idx=rank)
        else:
            mixer = RopeAttention(c, attn_layer_idx=rank, qk_norm=True, output_gate=True, zero_centered_norm=True)
        return HybridDecoderLayer(mixer, self.make_mlp(), c.hidden_size, c.rms_norm_eps)

    def make_mlp(self) -> nn.Module:
        return GatedMLP(self.config.hidden_size, self.config.intermediate_size)

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    def kv_cache_groups(self, dtype: torch.dtype) -> list[KVCacheGroupSpec]:
        """K/V pages for the full-attention layers plus one state slot per sequence in each linear layer."""
        linear = KVCacheGroupSpec(tuple(range(self.num_linear_layers)), self.linear_config.state_spec(dtype))
        return super().kv_cache_groups(dtype) + [linear]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_ctx: AttentionContext) -> torch.Tensor:
        return self.forward_with_states(input_ids, positions, attn_ctx)[0]

    def forward_with_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_ctx: AttentionContext,
                            states: LinearStates | None = None
                            ) -> tuple[torch.Tensor, list[list[LinearAttentionState]]]:
        """Like ``forward``, continuing each sequence b of linear layer l from ``states[l][b]`` (None: empty
        context); also returns the states after this batch, in the same [L][B] layout."""
        if states is None and self.num_linear_layers and _continues_a_context(attn_ctx.meta):
            raise ValueError("a sequence continues an earlier context: its linear-attention states must be passed")
        new_states = []

        def carry_states(layer_idx: int, layer: HybridDecoderLayer, rows: LayerRows) -> LayerRows:
            layer_states = states[len(new_states)] if states is not None and layer.is_linear else None
            hidden, layer_new = layer(*rows, layer_states)
            if layer_new is not None:
                new_states.append(layer_new)
            return rows._replace(hidden=hidden)

        return self.run_layers(input_ids, positions, attn_ctx, carry_states).hidden, new_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_text_model_name(name), tensor) for name, tensor in weights)


def _continues_a_context(meta: AttentionMetadata) -> bool:
    return any(meta.seq_lens[b] > meta.query_start_loc[b + 1] - meta.query_start_loc[b] for b in range(meta.num_seqs))


def _text_model_name(name: str) -> str:
    return _TEXT_PREFIX + name[len(_VL_PREFIX):] if name.startswith(_VL_PREFIX) else name


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's MLP: softmax top-k routed experts (renormalised) plus a sigmoid-gated shared expert."""

    def make_mlp(self) -> nn.Module:
        c = self.config
        return SharedExpertMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                               renormalize=True,
                               shared_intermediate_size=c.hf_config["shared_expert_intermediate_size"])
