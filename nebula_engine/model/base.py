"""Decoder-only causal LM skeleton; a family only says how to build layer ``i``.

Parameter names equal Hugging Face names (``model.layers.{i}...``, ``lm_head.weight``), so weight
loading is a lookup. The layer loop (embed -> decoder layers -> final norm) is written once, in
``CausalLM.run_layers``: the plain forward, PIC's combine and HYPIC all run it, changing what happens at a
layer through a ``LayerHook``. Legend: T = tokens in the flattened batch, Hd = hidden size, V = vocab.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable, NamedTuple

import torch
from torch import nn

from nebula_engine.kernels.attention import AttentionContext
from nebula_engine.kernels.cpu_embedding import Embedding
from nebula_engine.kernels.cpu_linear import Linear
from nebula_engine.kvcache.spec import KVCacheGroupSpec, full_attention_groups
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.gated_deltanet import GatedDeltaNet
from nebula_engine.model.layers import RMSNorm, RopeAttention
from nebula_engine.model.rotary import share_rotary_embeddings
from nebula_engine.model.weights import load_named_weights


class LayerRows(NamedTuple):
    """The rows a decoder layer runs on, in the order ``layer(positions, hidden, attn_ctx)`` takes them."""

    positions: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, Hd]
    attn_ctx: AttentionContext


# Runs decoder layer ``layer_idx`` on the rows in place of ``layer(*rows)`` and returns the rows the next layer
# runs on: the same rows with new hidden states, or fewer rows (and their own attention context).
LayerHook = Callable[[int, nn.Module, LayerRows], LayerRows]


class DecoderStack(nn.Module):
    """What HF calls ``model``: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module, ABC):
    """Interface the engine relies on: forward, compute_logits, load_weights, KV cache shapes."""

    # checkpoint names (regexes) that carry no parameters of ours
    ignored_weights: tuple[str, ...] = (r"rotary_emb\.inv_freq$",)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, [self.make_layer(i) for i in range(config.num_hidden_layers)])
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        share_rotary_embeddings(self)

    @abstractmethod
    def make_layer(self, layer_idx: int) -> nn.Module:
        """Decoder layer ``layer_idx``, called with ``forward(positions, hidden, attn_ctx)``."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions [T] (flattened varlen batch) -> final-normed hidden [T, Hd]."""
        return self.run_layers(input_ids, positions, attn_ctx).hidden

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_ctx: AttentionContext,
                   hook: LayerHook | None = None) -> LayerRows:
        """Embed the rows ``input_ids`` at ``positions`` [T], run them through every decoder layer, final-norm them.

        Without ``hook`` each layer is ``layer(positions, hidden, attn_ctx)``; with it, ``hook(layer_idx, layer,
        rows)`` runs the layer instead (another attention context, another token mixer, rows dropped). Returns the
        rows out of the last layer, their hidden states final-normed.
        """
        hidden = self.model.embed_tokens(input_ids)
        if hook is None:  # the engine's forward: no per-layer allocation
            for layer in self.model.layers:
                hidden = layer(positions, hidden, attn_ctx)
            return LayerRows(positions, self.model.norm(hidden), attn_ctx)
        rows = LayerRows(positions, hidden, attn_ctx)
        for layer_idx, layer in enumerate(self.model.layers):
            rows = hook(layer_idx, layer, rows)
        return rows._replace(hidden=self.model.norm(rows.hidden))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, Hd] -> fp32 logits [n, V]."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, ignore=self.ignored_weights,
                           tied_lm_head=self.config.tie_word_embeddings)
        if not self.config.tie_word_embeddings and isinstance(self.lm_head.weight, nn.Parameter):
            self._store_lm_head_transposed()  # an fp32 head; one that took GGUF blocks computes with them

    @torch.no_grad()
    def _store_lm_head_transposed(self) -> None:
        """Keep ``lm_head.weight`` [V, Hd] as a view of [Hd, V] storage; name, shape and values unchanged.

        Logits of a few rows (decode) are a skinny matmul whose speed is bound by reading the V x Hd
        weight; BLAS reads the [Hd, V] layout ~1.3x faster on CPU (measured 10.3 -> 7.8 ms for
        4 x 512 x 32000). A tied head shares the embedding table, whose row lookups want [V, Hd].
        """
        weight = self.lm_head.weight
        self.lm_head.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=weight.requires_grad)

    def attention_layers(self) -> list[RopeAttention]:
        """Attention modules ordered by their index into ``AttentionContext.kv_caches``."""
        layers = [m for m in self.modules() if isinstance(m, RopeAttention)]
        return sorted(layers, key=lambda m: m.attn_layer_idx)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layers())

    @property
    def num_linear_layers(self) -> int:
        """Linear-attention layers (a recurrent state per sequence instead of K/V); hybrid families override."""
        return 0

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        """Linear-attention modules ordered by their index into the engine's per-layer states."""
        layers = [m for m in self.modules() if isinstance(m, GatedDeltaNet)]
        return sorted(layers, key=lambda m: m.linear_layer_idx)

    def kv_cache_shape_per_layer(self) -> list[tuple[int, int, int]]:
        """``(num_kv_heads, head_dim, v_head_dim)`` for each full-attention layer, in kv_caches order."""
        return [(m.num_kv_heads, m.head_dim, m.v_head_dim) for m in self.attention_layers()]

    def kv_cache_groups(self, dtype: torch.dtype) -> list[KVCacheGroupSpec]:
        """What the engine's pool must hold for this model, one group per kind of layer storage."""
        return full_attention_groups(self.kv_cache_shape_per_layer(), dtype)
