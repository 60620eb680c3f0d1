"""Tiny GGUF files written from tiny HF checkpoints the way llama.cpp's ``convert_hf_to_gguf.py`` writes them.

What the converter does and this mirrors: GGUF tensor names from gguf's own ``TensorNameMap``; q/k rows of
``llama`` models permuted for llama.cpp's interleaved RoPE (``LlamaModel.permute``); Llama 3.1's RoPE scaling
written as a ``rope_freqs`` tensor of per-frequency divisors (``LlamaModel.generate_extra_tensors``); 1-D
tensors (norms, biases) kept in F32; a SentencePiece vocabulary as tokens, scores and token types
(``_create_vocab_sentencepiece``). The gguf package cannot quantize K-quants, so Q4_K / Q6_K tensors are
random blocks with scales chosen for weights of about HF's init size: the referee then reads the same file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the 'gguf' extra")
Q = gguf.GGMLQuantizationType
KQUANT_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of each block's fp16 scales


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's neox row order -> llama.cpp's interleaved one, per head (``LlamaModel.permute``)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """``rope_freqs``: the divisor of each inverse frequency, computed as llama.cpp's converter does."""
    base, factor = rope["rope_theta"], rope["factor"]
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def random_kquant_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes] of K-quant blocks: random quants and sub-scales, fp16 super-scales near 1e-4."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block, block_bytes), dtype=np.uint8)
    for offset in KQUANT_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(5e-5, 1.5e-4, blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _encode(name: str, tensor: torch.Tensor, qtype, seed: int) -> tuple[np.ndarray, object]:
    """The bytes (or values) and type a tensor is stored with; 1-D and indivisible rows fall back to F32."""
    values = tensor.float().numpy()
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if values.ndim == 1 or values.shape[-1] % block or qtype == Q.F32:
        return values, Q.F32
    if qtype == Q.F16:
        return values.astype(np.float16), Q.F16
    if qtype in KQUANT_SCALE_OFFSETS:
        return random_kquant_blocks(qtype, values.shape[0], values.shape[1], seed), qtype
    return gguf.quants.quantize(values, qtype), qtype


def write_gguf(checkpoint: Path, out: Path, qtype=Q.F32, *, tokenizer: bool = False, architecture: str | None = None,
               extra_metadata: dict | None = None, tensor_types: dict | None = None) -> Path:
    """A GGUF of the HF checkpoint ``checkpoint`` (llama, qwen2 or qwen3) at ``out``.

    ``architecture`` overrides the one written (for error tests); ``extra_metadata`` adds ``{key: value}``
    (strings, ints, floats); ``tensor_types`` stores named GGUF tensors as raw bytes of another type.
    """
    config = json.loads((checkpoint / "config.json").read_text())
    family = config["model_type"]
    arch = architecture or family
    writer = gguf.GGUFWriter(str(out), arch)
    _write_metadata(writer, config, arch)
    for key, value in (extra_metadata or {}).items():
        {str: writer.add_string, int: writer.add_uint32, float: writer.add_float32}[type(value)](key, value)
    if tokenizer:
        _write_sentencepiece_vocab(writer, checkpoint)
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}.get(family, gguf.MODEL_ARCH.QWEN3)
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    for seed, (hf_name, tensor) in enumerate(sorted(load_file(checkpoint / "model.safetensors").items())):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if family == "llama" and ".attn_q." in name:
            tensor = llama_cpp_permute(tensor, config["num_attention_heads"])
        elif family == "llama" and ".attn_k." in name:
            tensor = llama_cpp_permute(tensor, config["num_key_value_heads"])
        if name in (tensor_types or {}):
            raw = np.zeros((tensor.shape[0], tensor.shape[1] // 256 * gguf.GGML_QUANT_SIZES[tensor_types[name]][1]),
                           np.uint8)
            writer.add_tensor(name, raw, raw_dtype=tensor_types[name])
            continue
        data, stored = _encode(name, tensor, qtype, seed)
        writer.add_tensor(name, data, raw_dtype=stored if stored not in (Q.F32, Q.F16) else None)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, config["head_dim"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_metadata(writer, config: dict, arch: str) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_key_length(config["head_dim"])  # as the converter does whenever config.json states head_dim
    writer.add_value_length(config["head_dim"])
    if arch == "llama":  # the rotary width
        writer.add_rope_dimension_count(config["head_dim"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])


def _write_sentencepiece_vocab(writer, checkpoint: Path) -> None:
    """The checkpoint's ``tokenizer.model`` (Llama 2 / Mistral SentencePiece) as llama.cpp stores it."""
    import sentencepiece

    from nebula_engine.model.tiny import MISTRAL_TEMPLATE

    processor = sentencepiece.SentencePieceProcessor(model_file=str(checkpoint / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(processor.vocab_size()):
        tokens.append(processor.id_to_piece(i).encode())
        scores.append(processor.get_score(i))
        types.append(gguf.TokenType.UNKNOWN if processor.is_unknown(i) else gguf.TokenType.CONTROL
                     if processor.is_control(i) else gguf.TokenType.BYTE if processor.is_byte(i)
                     else gguf.TokenType.UNUSED if processor.is_unused(i) else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(processor.unk_id())
    writer.add_add_bos_token(True)
    writer.add_chat_template(MISTRAL_TEMPLATE)
