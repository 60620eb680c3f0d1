"""GGUF loading: every common storage type read like transformers' own GGUF loader reads it; llama.cpp's q/k
permutation, llama3 ``rope_freqs``, biases and tied embeddings against the safetensors checkpoint they came
from; the tokenizer and chat template from the metadata; a clear error for what is not supported."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
import transformers

from nebula_engine import LLM, SamplingParams
from nebula_engine.engine.tokenizer import Tokenizer
from nebula_engine.kernels.attention import AttentionContext
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.loader import load_model
from tests.gguf_files import Q, write_gguf
from tests.model_cases import CASES_BY_NAME, ModelCase, checkpoint_factory  # noqa: F401  (fixture)

# every row a multiple of 256 (the K-quant block), so each 2-D tensor is stored in the type under test
QUANT_CASE = ModelCase("llama_h256_for_gguf", "llama",
                       dict(hidden_size=256, intermediate_size=512, head_dim=64, initializer_range=0.05), seed=14)
# transformers' Qwen3 GGUF reader ignores attention.key_length and keeps Qwen3Config's head_dim of 128
QWEN3_CASE = ModelCase("qwen3_hd128_tied_for_gguf", "qwen3", dict(num_attention_heads=2, num_key_value_heads=1,
                                                                   head_dim=128, tie_word_embeddings=True), seed=15)
STORAGE_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K)
PROMPT_LENS = [7, 12]


def _prompts(vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator) for n in PROMPT_LENS]


@torch.no_grad()
def _our_logits(model, prompts: list[torch.Tensor]) -> torch.Tensor:
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    return model.compute_logits(model(torch.cat(prompts), positions, AttentionContext.dense(PROMPT_LENS)))


@torch.no_grad()
def _hf_logits(hf_model, prompts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([hf_model(p[None]).logits[0] for p in prompts])


def _in_own_dir(tmp_path, checkpoint, qtype, **kwargs):
    directory = tmp_path / qtype.name
    directory.mkdir()
    write_gguf(checkpoint, directory / f"tiny-{qtype.name}.gguf", qtype, **kwargs)
    return directory


@pytest.mark.parametrize("qtype", STORAGE_TYPES, ids=lambda q: q.name)
def test_logits_match_transformers_gguf_loader(qtype, checkpoint_factory, tmp_path):
    directory = _in_own_dir(tmp_path, checkpoint_factory(QUANT_CASE), qtype)
    name = f"tiny-{qtype.name}.gguf"

    model, config, source = load_model(str(directory))  # the directory's one .gguf
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                                  dtype=torch.float32).eval()
    prompts = _prompts(config.vocab_size)
    logits, expected = _our_logits(model, prompts), _hf_logits(reference, prompts)

    assert source == directory / name and config.model_type == "llama" and not config.tie_word_embeddings
    assert expected.std() > 0.3, "random logits too flat to compare meaningfully"
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("case_name", ["llama_gqa2", "llama3_rope_scaling_tied", "llama_attention_mlp_bias_mqa"])
def test_f32_gguf_computes_like_the_checkpoint_it_was_converted_from(case_name, checkpoint_factory, tmp_path):
    """The referee is transformers on the safetensors: it knows llama3 scaling and biases, which its GGUF
    loader drops; a q/k permutation left in place would show too."""
    checkpoint = checkpoint_factory(CASES_BY_NAME[case_name])
    path = write_gguf(checkpoint, tmp_path / "tiny.gguf", Q.F32)

    model, config, _ = load_model(str(path))
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = _prompts(config.vocab_size, seed=1)

    hf_config = ModelConfig.from_hf(checkpoint)
    for field in ("tie_word_embeddings", "attention_bias", "mlp_bias", "num_key_value_heads", "head_dim"):
        assert getattr(config, field) == getattr(hf_config, field), field
    torch.testing.assert_close(_our_logits(model, prompts), _hf_logits(reference, prompts), atol=1e-4, rtol=1e-4)


def test_qwen3_gguf_matches_transformers_gguf_loader(checkpoint_factory, tmp_path):
    """No q/k permutation for Qwen3 (llama.cpp rotates it neox-style), per-head q/k norms, tied embeddings."""
    directory = _in_own_dir(tmp_path, checkpoint_factory(QWEN3_CASE), Q.Q8_0)
    model, config, _ = load_model(str(directory))
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file="tiny-Q8_0.gguf",
                                                                  dtype=torch.float32).eval()
    prompts = _prompts(config.vocab_size, seed=2)
    assert config.model_type == "qwen3" and config.tie_word_embeddings
    torch.testing.assert_close(_our_logits(model, prompts), _hf_logits(reference, prompts), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case_name", ["qwen2_gqa2_qkv_bias", "qwen2_mqa_tied_theta1e6"])
def test_qwen2_gguf_matches_transformers_gguf_loader_and_its_source(case_name, checkpoint_factory, tmp_path):
    """Qwen2: biases on q/k/v only, no q/k permutation, tied or untied head; both referees agree with us."""
    checkpoint = checkpoint_factory(CASES_BY_NAME[case_name])
    directory = _in_own_dir(tmp_path, checkpoint, Q.Q8_0)
    model, config, _ = load_model(str(directory))
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file="tiny-Q8_0.gguf",
                                                                  dtype=torch.float32).eval()
    prompts = _prompts(config.vocab_size, seed=3)
    assert config.model_type == "qwen2" and config.attention_bias
    assert model.model.layers[0].self_attn.o_proj.bias is None
    torch.testing.assert_close(_our_logits(model, prompts), _hf_logits(reference, prompts), atol=1e-4, rtol=1e-4)
    f32 = write_gguf(checkpoint, tmp_path / "tiny-f32.gguf", Q.F32)
    source = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    torch.testing.assert_close(_our_logits(load_model(str(f32))[0], prompts), _hf_logits(source, prompts),
                               atol=1e-4, rtol=1e-4)


def test_engine_on_a_gguf_tokenizes_chats_and_decodes_like_the_source_checkpoint(checkpoint_factory, tmp_path):
    """SentencePiece vocabulary (Llama 2's kind), BOS policy and chat template come from the GGUF metadata."""
    checkpoint = checkpoint_factory(CASES_BY_NAME["llama_gqa2"])
    directory = _in_own_dir(tmp_path, checkpoint, Q.F32, tokenizer=True)
    from_gguf = LLM(str(directory), page_size=4, num_pages=64)
    from_safetensors = LLM(str(checkpoint), page_size=4, num_pages=64)

    ours = Tokenizer(directory / "tiny-F32.gguf")
    reference = transformers.AutoTokenizer.from_pretrained(directory, gguf_file="tiny-F32.gguf")
    for text in ("Hello world", "  two leading spaces,\ttabs\nand lines", "Ünïcödé 日本語 🙂", "</s><s> 1234"):
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text), skip_special_tokens=True)
    assert ours.prompt_prefix_ids == [1]  # BOS, as tokenizer.ggml.add_bos_token says
    chat = [{"role": "user", "content": "Name three colours."}]
    expected_text = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat)[0] == expected_text == Tokenizer(checkpoint).apply_chat_template(chat)[0]

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got, expected = from_gguf.chat(chat, params)[0], from_safetensors.chat(chat, params)[0]
    assert got.prompt_token_ids == expected.prompt_token_ids
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.outputs[0].token_logprobs == pytest.approx(expected.outputs[0].token_logprobs, abs=1e-4)


# ---- what is not supported says so ----

@pytest.fixture
def quant_checkpoint(checkpoint_factory):
    return checkpoint_factory(QUANT_CASE)


@pytest.mark.parametrize("kwargs,message", [
    (dict(architecture="gpt2"), r"GGUF architecture 'gpt2' .* not supported; supported: llama, qwen2, qwen3"),
    (dict(tensor_types={"blk.1.ffn_down.weight": Q.Q8_K}), r"blk\.1\.ffn_down\.weight is Q8_K, a type"),
    (dict(extra_metadata={"llama.expert_count": 8}), r"8 experts \(MoE\) is not supported"),
    (dict(extra_metadata={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}),
     r"RoPE scaling 'yarn' is not supported"),
], ids=["architecture", "quant-type", "moe", "yarn"])
def test_unsupported_content_is_named(quant_checkpoint, tmp_path, kwargs, message):
    path = write_gguf(quant_checkpoint, tmp_path / "odd.gguf", Q.Q8_0, **kwargs)
    with pytest.raises(ValueError, match=message):
        load_model(str(path))


def test_broken_or_ambiguous_files_are_named(quant_checkpoint, tmp_path):
    good = write_gguf(quant_checkpoint, tmp_path / "a.gguf", Q.Q8_0)
    (tmp_path / "truncated.gguf").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf at all" * 10)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"truncated\.gguf is not a readable GGUF file: truncated"):
        load_model(str(tmp_path / "truncated.gguf"))
    with pytest.raises(ValueError, match=r"garbage\.gguf is not a readable GGUF file: no GGUF magic"):
        load_model(str(tmp_path / "garbage.gguf"))
    with pytest.raises(ValueError, match=r"weights\.bin is a file but not a \.gguf"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match=r"holds 3 \.gguf files \(a\.gguf, garbage\.gguf, truncated\.gguf\)"):
        load_model(str(tmp_path))
    shutil.copy(quant_checkpoint / "config.json", tmp_path / "config.json")  # an HF checkpoint dir wins ...
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):  # ... and says what it lacks
        load_model(str(tmp_path))


def test_missing_gguf_package_names_the_extra(quant_checkpoint, tmp_path, monkeypatch):
    path = write_gguf(quant_checkpoint, tmp_path / "a.gguf", Q.Q8_0)
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` meets when the extra is not installed
    with pytest.raises(ImportError, match=r"needs the 'gguf' extra: pip install 'nebula-engine\[gguf\]'"):
        load_model(str(path))
