"""A llama.cpp GGUF file as a checkpoint: its metadata as an HF-style config, its tensors under HF names.

Tensors are dequantized (any type ``gguf.quants.dequantize`` knows: F32, F16, BF16, Q4_0 ... Q8_0, the
K-quants, ...) and cast to the engine dtype; the model then computes in that dtype. An fp32 model on CPU can keep
the linear layers' blocks instead (``weights(keep_blocks=True)``), computed by ``kernels.quant_linear``.
llama.cpp stores the q/k rows of ``llama`` models permuted for its interleaved RoPE; they are put back in HF's
neox order here. Needs the optional ``gguf`` package: ``pip install 'nebula-engine[gguf]'``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from nebula_engine.kernels import quant_linear
from nebula_engine.kernels.quant_linear import QuantizedWeight

GGUF_EXTRA = "reading GGUF files needs the 'gguf' extra: pip install 'nebula-engine[gguf]'"


@dataclass(frozen=True)
class GGUFArchitecture:
    model_type: str  # our registry's name for it
    permuted_qk: bool  # llama.cpp's converter permutes q/k rows (and biases) of this architecture
    tokenizer_class: str  # the transformers class AutoTokenizer picks for such a file (the slow way)


# general.architecture -> how to read it; a dense decoder with GGUF's standard tensor names
ARCHITECTURES = {
    "llama": GGUFArchitecture("llama", permuted_qk=True, tokenizer_class="TokenizersBackend"),
    "qwen2": GGUFArchitecture("qwen2", permuted_qk=False, tokenizer_class="Qwen2Tokenizer"),
    "qwen3": GGUFArchitecture("qwen3", permuted_qk=False, tokenizer_class="Qwen2Tokenizer"),
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling, as per-frequency divisors


def import_gguf():
    """The ``gguf`` module, or an ImportError naming the extra that provides it."""
    try:
        import gguf
    except ImportError as exc:
        raise ImportError(GGUF_EXTRA) from exc
    return gguf


class GGUFCheckpoint:
    """One ``.gguf`` file, memory-mapped; nothing is dequantized before ``weights()`` is iterated."""

    def __init__(self, path: str | Path):
        import_gguf()
        from nebula_engine.model.gguf_reader import GGUFFile

        self._file = GGUFFile(path)
        self.path = self._file.path
        self._tensors = self._file.tensors
        self.architecture = self.metadata("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.architecture!r} of {self.path.name} is not supported; "
                             f"supported: {', '.join(sorted(ARCHITECTURES))}")
        self._arch = ARCHITECTURES[self.architecture]

    @property
    def tokenizer_class(self) -> str:
        return self._arch.tokenizer_class

    def metadata(self, key: str, default: Any = KeyError) -> Any:
        if key not in self._file.metadata:
            if default is KeyError:
                raise ValueError(f"GGUF file {self.path.name} lacks metadata {key!r}")
            return default
        return self._file.metadata[key]

    def hf_config(self) -> dict[str, Any]:
        """config.json-style fields for ``ModelConfig.from_hf``, from llama.cpp's metadata keys."""
        arch = lambda key, default=KeyError: self.metadata(f"{self.architecture}.{key}", default)  # noqa: E731
        if arch("expert_count", 0):
            raise ValueError(f"GGUF {self.architecture} model with {arch('expert_count')} experts (MoE) is not "
                             "supported; only dense models are")
        heads, hidden = arch("attention.head_count"), arch("embedding_length")
        kv_heads = arch("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise ValueError(f"GGUF file sets a KV head count per layer ({kv_heads}); not supported")
        head_dim = arch("attention.key_length", hidden // heads)
        return {
            "model_type": self._arch.model_type,
            "hidden_size": hidden,
            "num_hidden_layers": arch("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "intermediate_size": arch("feed_forward_length"),
            "vocab_size": self._tensor("token_embd.weight").shape[0],
            "rms_norm_eps": arch("attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": arch("context_length", 4096),
            "rope_parameters": {"rope_theta": arch("rope.freq_base", 10000.0),
                                "partial_rotary_factor": arch("rope.dimension_count", head_dim) / head_dim,
                                **self._rope_scaling()},
            # llama.cpp writes the output projection only when it is not the embedding matrix
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in self._tensors,
            "bos_token_id": self.metadata("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.metadata("tokenizer.ggml.eos_token_id", None),
        }

    def _rope_scaling(self) -> dict[str, Any]:
        scaling = self.metadata(f"{self.architecture}.rope.scaling.type", "none")
        has_factors = _ROPE_FREQS in self._tensors
        if scaling == "none" and has_factors:
            factors = self._dequantize(self._tensor(_ROPE_FREQS))
            return {"rope_type": "freq_factors", "freq_factors": factors.reshape(-1).tolist()}
        if scaling == "none":
            return {}
        if scaling == "linear" and not has_factors:
            return {"rope_type": "linear", "factor": self.metadata(f"{self.architecture}.rope.scaling.factor")}
        described = repr(scaling) + (" with rope_freqs" if has_factors else "")
        raise ValueError(f"GGUF RoPE scaling {described} is not supported; "
                         "supported: none, linear, llama3 (rope_freqs)")

    def weights(self, dtype: torch.dtype,
                keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(HF name, tensor in ``dtype``) for every model tensor, dequantized one at a time.

        With ``keep_blocks`` (asked for an fp32 model on CPU) a 2-D tensor stored in a block type that the CPU
        quantized-linear kernel computes with (F16, BF16, Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) comes as a
        ``QuantizedWeight``: its blocks, a view of the file's read-only mapping, not a copy (llama's q/k rows, put
        back in HF's order, are the exception). The weight loader puts those in the linear layers and the token
        embedding (whose lookups dequantize the rows they read). A tied model's embedding comes once more as
        ``lm_head.weight``, for the LM head to compute with the same blocks. Without the kernel (no compiler) every
        tensor is dequantized.
        """
        config = self.hf_config()
        keep_blocks = keep_blocks and dtype == torch.float32 and quant_linear.load()
        for name, tensor in self._tensors.items():
            if name == _ROPE_FREQS:
                continue
            hf_name = self._hf_name(name)
            values = self._blocks(tensor) if keep_blocks else None
            if values is None:
                values = torch.from_numpy(np.require(self._dequantize(tensor), requirements="W")).to(dtype)
            if self._arch.permuted_qk and ".attn_q." in name:
                values = _unpermuted(values, config["num_attention_heads"])
            elif self._arch.permuted_qk and ".attn_k." in name:
                values = _unpermuted(values, config["num_key_value_heads"])
            yield hf_name, values
        embedding = self._tensor("token_embd.weight")
        if keep_blocks and config["tie_word_embeddings"] and (head := self._blocks(embedding)) is not None:
            yield "lm_head.weight", head

    def _blocks(self, tensor) -> QuantizedWeight | None:
        """The tensor's blocks where the kernel computes with them (F32 stays a tensor: the fp32 path packs it)."""
        if len(tensor.shape) != 2 or tensor.qtype.name == "F32" or not quant_linear.computes(tensor.qtype,
                                                                                              tensor.shape[1]):
            return None
        return QuantizedWeight.from_numpy(self._file.tensor_bytes(tensor), tensor.qtype, tensor.shape)

    def _hf_name(self, name: str) -> str:
        stem, _, kind = name.rpartition(".")
        if stem in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[stem]}.{kind}"
        match = _BLOCK_TENSOR.match(name)
        if match is None or match["part"] not in _BLOCK_NAMES:
            raise ValueError(f"GGUF tensor {name} of {self.path.name} has no counterpart in a "
                             f"{self._arch.model_type} model")
        return f"model.layers.{match['layer']}.{_BLOCK_NAMES[match['part']]}.{match['kind']}"

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise ValueError(f"GGUF file {self.path.name} lacks tensor {name}")
        return self._tensors[name]

    def _dequantize(self, tensor) -> np.ndarray:
        """float32 values shaped like the torch tensor."""
        from gguf.quants import dequantize

        try:
            values = dequantize(self._file.tensor_bytes(tensor), tensor.qtype)
        except NotImplementedError as exc:
            raise ValueError(f"GGUF tensor {tensor.name} is {tensor.qtype.name}, a type the gguf package "
                             "cannot dequantize") from exc
        return values.astype(np.float32, copy=False).reshape(tensor.shape)


def _unpermuted(values: torch.Tensor | QuantizedWeight, num_heads: int) -> torch.Tensor | QuantizedWeight:
    """``unpermute_rows`` of values, or of blocks: a row of blocks is one row of values."""
    if isinstance(values, QuantizedWeight):
        return QuantizedWeight(unpermute_rows(values.data, num_heads), values.qtype, values.shape)
    return unpermute_rows(values, num_heads)


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: within each head, rows (2i, 2i+1) go back to (i, i + D/2).

    llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders HF's neox pairs for its
    interleaved rotation; weight [H*D, Hd] or bias [H*D].
    """
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
