"""A token-embedding table that may stay in its GGUF blocks: a lookup dequantizes only the rows it reads.

Dequantized at load, Qwen2.5-1.5B's table (151,936 x 1,536) is 890 MiB of fp32 per process, more than the
model's Q4_K/Q6_K blocks of every other tensor together; kept in its blocks (Q6_K here) it is 191 MiB of the
file's shared, read-only mapping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nebula_engine.kernels.quant_linear import QuantizedWeight, dequantize_rows


class Embedding(nn.Embedding):
    """``nn.Embedding`` (same parameter and name) whose table may be replaced by a ``QuantizedWeight``."""

    def use_quantized_weight(self, weight: QuantizedWeight) -> None:
        """Look rows up in ``weight``'s blocks from now on; the fp32 ``weight`` parameter is dropped (it leaves the
        module's parameters and state dict: the blocks are not a parameter)."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"a quantized table {list(weight.shape)} cannot replace a "
                             f"[{self.num_embeddings}, {self.embedding_dim}] embedding")
        del self.weight
        self.weight = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):  # index_select raises on an id out of range, as F.embedding
            return dequantize_rows(self.weight, input_ids)
        return F.embedding(input_ids, self.weight)
