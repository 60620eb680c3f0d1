"""GGUF weights kept in their blocks (``quantization="gguf"``, the default on CPU in fp32): the model computes what
the dequantize-at-load model computes, the blocks stay views of the mapped file, fused q/k/v stacks blocks of
different types, the token embedding looks its rows up in blocks, and what cannot take blocks (bf16) is
dequantized."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from nebula_engine import LLM, SamplingParams
from nebula_engine.kernels import quant_linear
from nebula_engine.kernels.attention import AttentionContext
from nebula_engine.kernels.quant_linear import QuantizedWeight, StackedQuantizedWeight
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.layers import RopeAttention
from nebula_engine.model.loader import load_model
from tests.gguf_files import Q, random_kquant_blocks, write_gguf
from tests.model_cases import ModelCase, checkpoint_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel with")

# every row a whole number of 256-value blocks; tied, so the LM head computes with the embedding's blocks
TIED_CASE = ModelCase("llama_h256_tied_for_quant", "llama", dict(hidden_size=256, intermediate_size=512, head_dim=64,
                                                                 initializer_range=0.05, tie_word_embeddings=True),
                      seed=21)
UNTIED_CASE = ModelCase("llama_h256_untied_for_quant", "llama",
                        dict(hidden_size=256, intermediate_size=512, head_dim=64, initializer_range=0.05), seed=22)


@torch.no_grad()
def _logits(model, prompts: list[torch.Tensor]) -> torch.Tensor:
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    return model.compute_logits(model(torch.cat(prompts), positions, AttentionContext.dense([len(p) for p in prompts])))


def _quantized(model) -> dict[str, object]:
    return {name: module.weight for name, module in model.named_modules()
            if isinstance(getattr(module, "weight", None), QuantizedWeight)}


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory mapped from ``path`` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.fixture(scope="module")
def quantization_on():
    assert quant_linear.load(), "the kernel did not build on a machine with a C++ compiler (see the log)"


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_blocks_compute_what_dequantized_weights_compute(qtype, checkpoint_factory, tmp_path, quantization_on):
    path = write_gguf(checkpoint_factory(TIED_CASE), tmp_path / "tiny.gguf", qtype)
    blocks, config, _ = load_model(str(path))
    dense, _, _ = load_model(str(path), quantization="float32")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in (5, 23)]  # decode and GEMM
    expected = _logits(dense, prompts)

    assert config.tie_word_embeddings and expected.std() > 0.3
    torch.testing.assert_close(_logits(blocks, prompts), expected, atol=1e-4, rtol=1e-4)
    attention = blocks.model.layers[0].self_attn
    assert isinstance(attention.qkv_weight, StackedQuantizedWeight)
    assert [part.qtype for part in attention.qkv_weight.parts] == [qtype] * 3
    assert isinstance(blocks.lm_head.weight, QuantizedWeight) and blocks.lm_head.weight.qtype == qtype
    table, head = blocks.model.embed_tokens.weight, blocks.lm_head.weight
    assert isinstance(table, QuantizedWeight) and table.data.data_ptr() == head.data.data_ptr()  # tied: one copy
    assert not {"lm_head.weight", "model.embed_tokens.weight"} & set(dict(blocks.named_parameters()))
    assert not _quantized(dense)


def test_blocks_are_views_of_the_mapped_file(checkpoint_factory, tmp_path, quantization_on):
    path = write_gguf(checkpoint_factory(TIED_CASE), tmp_path / "tiny.gguf", Q.Q8_0)
    model, _, _ = load_model(str(path))
    mappings = _file_mappings(path)
    if not mappings:
        pytest.skip("no /proc/self/maps to find the file's mapping in")
    in_file = {name: any(start <= weight.data.data_ptr() < end for start, end in mappings)
               for name, weight in _quantized(model).items()}
    # llama.cpp's q/k rows are put back in HF's order: a copy; every other block stays in the file's pages
    assert in_file and all(mapped != (".q_proj" in name or ".k_proj" in name) for name, mapped in in_file.items())


def test_what_cannot_take_blocks_is_dequantized(checkpoint_factory, tmp_path, quantization_on):
    path = write_gguf(checkpoint_factory(UNTIED_CASE), tmp_path / "tiny.gguf", Q.Q8_0)
    untied, config, _ = load_model(str(path))
    assert not config.tie_word_embeddings
    assert isinstance(untied.lm_head.weight, QuantizedWeight)  # an untied head computes with its own blocks
    assert isinstance(untied.model.layers[1].mlp.down_proj.weight, QuantizedWeight)
    assert isinstance(untied.model.embed_tokens.weight, QuantizedWeight)  # its own blocks, not the head's
    assert untied.model.embed_tokens.weight is not untied.lm_head.weight
    bf16, _, _ = load_model(str(path), dtype=torch.bfloat16)  # the kernel computes in fp32 only
    assert not _quantized(bf16) and bf16.model.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16
    dequantized, _, _ = load_model(str(path), quantization="float32")
    assert isinstance(dequantized.lm_head.weight, torch.nn.Parameter)  # the fp32 head is stored transposed
    assert dequantized.lm_head.weight.stride() == (1, config.vocab_size)
    prompts = [torch.arange(3, 12), torch.arange(40, 97)]  # the head's GEMV and its GEMM
    torch.testing.assert_close(_logits(untied, prompts), _logits(dequantized, prompts), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"quantization must be one of gguf, float32, got 'int4'"):
        load_model(str(path), quantization="int4")


def test_engine_option_decodes_the_same_tokens(checkpoint_factory, tmp_path, quantization_on):
    path = write_gguf(checkpoint_factory(TIED_CASE), tmp_path / "tiny.gguf", Q.Q4_1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [250, *range(1, 13)]}]
    outputs = {}
    for quantization in ("gguf", "float32"):
        llm = LLM(str(path), quantization=quantization, page_size=4, num_pages=64, skip_tokenizer_init=True)
        model = llm.llm_engine.model_runner.model
        assert bool(_quantized(model)) == (quantization == "gguf")
        outputs[quantization] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert outputs["gguf"] == outputs["float32"]


def test_fused_projections_stack_blocks_of_different_types(quantization_on):
    """q Q5_0, k Q6_K, v left in fp32: one stacked weight, the children's own blocks, the fp32 child as F32 rows."""
    config = ModelConfig.from_hf(dict(model_type="llama", hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, intermediate_size=64,
                                      attention_bias=True))
    torch.manual_seed(3)
    attention = RopeAttention(config, attn_layer_idx=0)
    import gguf

    q_values = torch.randn(256, 256).numpy()
    q_blocks = QuantizedWeight.from_numpy(gguf.quants.quantize(q_values, Q.Q5_0), Q.Q5_0, (256, 256))
    k_blocks = QuantizedWeight.from_numpy(random_kquant_blocks(Q.Q6_K, 128, 256, seed=4), Q.Q6_K, (128, 256))
    reference = RopeAttention(config, attn_layer_idx=0)
    reference.load_state_dict(attention.state_dict())
    with torch.no_grad():
        reference.q_proj.weight.copy_(q_blocks.dequantize())
        reference.k_proj.weight.copy_(k_blocks.dequantize())
    attention.q_proj.use_quantized_weight(q_blocks)
    attention.k_proj.use_quantized_weight(k_blocks)
    attention.refuse()

    parts = attention.qkv_weight.parts
    assert parts[:2] == (q_blocks, k_blocks) and parts[2].qtype == quant_linear.F32
    x = torch.randn(6, 256)
    with torch.no_grad():
        ours = attention(torch.arange(6), x, AttentionContext.dense([6]))
        expected = reference(torch.arange(6), x, AttentionContext.dense([6]))
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
