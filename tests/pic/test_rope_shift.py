"""Re-rotating cached keys: RoPE at p, then a shift by Δ, equals RoPE at p + Δ (spec A0)."""

from __future__ import annotations

import pytest
import torch

from nebula_engine.model.config import RopeConfig, RopeScaling
from nebula_engine.model.rotary import RotaryEmbedding
from nebula_engine.pic.rope_shift import shift_cached_keys, shift_keys
from tests.model_cases import CASES_BY_NAME, build_checkpoint

# angles near 300 rad lose ~2e-5 to fp32 rounding whichever way they are formed; values are O(1)
ATOL = 1e-4

YARN = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=64)
DEEPSEEK_YARN = RopeScaling(type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                            mscale_all_dim=0.707)  # attention_factor = mscale(40, 1) / mscale(40, .707) != 1
ROPES = {
    "neox_full": (RopeConfig(theta=10000.0, rotary_dim=16), 16),
    "neox_partial_quarter": (RopeConfig(theta=10000.0, rotary_dim=8), 32),
    "interleaved": (RopeConfig(theta=10000.0, rotary_dim=16, style="interleaved"), 16),
    "neox_yarn_partial": (RopeConfig(theta=1e6, rotary_dim=12, scaling=YARN), 20),
    "interleaved_deepseek_yarn": (RopeConfig(theta=10000.0, rotary_dim=16, style="interleaved",
                                             scaling=DEEPSEEK_YARN), 16),
}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ROPES)
@pytest.mark.parametrize("delta", [37, -5, 250])
def test_shift_equals_rope_at_shifted_positions(name, delta):
    rope, head_dim = ROPES[name]
    rotary = RotaryEmbedding(rope)
    if rope.scaling is not None:
        assert rotary.attention_factor != 1.0  # otherwise a doubly scaled shift would pass unnoticed
    k = randn(9, 3, head_dim)
    positions = torch.arange(9) + 10
    shifted = shift_keys(rotary(positions, k), delta, rotary)
    torch.testing.assert_close(shifted, rotary(positions + delta, k), atol=ATOL, rtol=0)
    assert not torch.allclose(shifted, rotary(positions, k), atol=1e-2)
    torch.testing.assert_close(shifted[..., rope.rotary_dim:], k[..., rope.rotary_dim:], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["neox_partial_quarter", "interleaved_deepseek_yarn"])
def test_per_token_deltas_and_round_trip(name):
    rope, head_dim = ROPES[name]
    rotary = RotaryEmbedding(rope)
    k = randn(6, 2, head_dim, seed=1)
    positions = torch.tensor([0, 1, 2, 0, 1, 2])  # two segments, each prefilled alone
    deltas = torch.tensor([5, 5, 5, 40, 40, 40])  # each moved to its own global offset
    cached = rotary(positions, k)
    torch.testing.assert_close(shift_keys(cached, deltas, rotary), rotary(positions + deltas, k), atol=ATOL, rtol=0)
    torch.testing.assert_close(shift_keys(shift_keys(cached, deltas, rotary), -deltas, rotary), cached,
                               atol=ATOL, rtol=0)
    with pytest.raises(ValueError):
        shift_keys(cached, torch.tensor([1, 2]), rotary)


def _slot_positions(page_size: int, pages: list[int], num_tokens: int) -> list[tuple[int, int]]:
    return [(pages[t // page_size], t % page_size) for t in range(num_tokens)]


def _flat_slots(page_size: int, slots: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([page * page_size + slot for page, slot in slots])


@pytest.mark.parametrize("dtype,atol", [(torch.float32, ATOL), (torch.bfloat16, 5e-2)])
def test_shift_cached_keys_touches_only_named_slots_and_rotary_dims(dtype, atol):
    rope = RopeConfig(theta=10000.0, rotary_dim=4)  # D/4: partial rotary
    rotary = RotaryEmbedding(rope)
    page_size, num_tokens, pages, delta = 4, 10, [4, 1, 3], 23  # page 3 holds tokens 8, 9 in slots 0, 1
    raw_keys = randn(num_tokens, 2, 16, seed=2)
    positions = torch.arange(num_tokens)
    k_cache = randn(6, page_size, 2, 16, seed=3).to(dtype)
    slots = _slot_positions(page_size, pages, num_tokens)
    for token, (page, slot) in enumerate(slots):
        k_cache[page, slot] = rotary(positions, raw_keys)[token].to(dtype)
    before = k_cache.clone()

    shift_cached_keys(k_cache, _flat_slots(page_size, slots), delta, rotary)

    expected = rotary(positions + delta, raw_keys)
    for token, (page, slot) in enumerate(slots):
        torch.testing.assert_close(k_cache[page, slot].float(), expected[token], atol=atol, rtol=0)
    untouched = torch.ones(k_cache.shape, dtype=torch.bool)
    for page, slot in slots:
        untouched[page, slot, :, :rope.rotary_dim] = False
    assert torch.equal(k_cache[untouched], before[untouched])


def test_shift_cached_latent_keys_touches_only_k_pe():
    rank, rope_dim, page_size, num_tokens, pages, delta = 8, 16, 4, 6, [2, 0], -3
    rotary = RotaryEmbedding(ROPES["interleaved_deepseek_yarn"][0])
    k_pe = randn(num_tokens, rope_dim, seed=4)
    positions = torch.arange(num_tokens) + 7
    latent_cache = randn(3, page_size, rank + rope_dim, seed=5)
    slots = _slot_positions(page_size, pages, num_tokens)
    rotated = rotary(positions, k_pe[:, None, :])[:, 0]
    for token, (page, slot) in enumerate(slots):
        latent_cache[page, slot, rank:] = rotated[token]
    before = latent_cache.clone()

    shift_cached_keys(latent_cache, _flat_slots(page_size, slots), delta, rotary, latent_rope_dim=rope_dim)

    expected = rotary(positions + delta, k_pe[:, None, :])[:, 0]
    for token, (page, slot) in enumerate(slots):
        torch.testing.assert_close(latent_cache[page, slot, rank:], expected[token], atol=ATOL, rtol=0)
    untouched = torch.ones(latent_cache.shape, dtype=torch.bool)
    for page, slot in slots:
        untouched[page, slot, rank:] = False
    assert torch.equal(latent_cache[untouched], before[untouched])
    with pytest.raises(ValueError):
        shift_cached_keys(latent_cache, _flat_slots(page_size, slots), delta, rotary, latent_rope_dim=8)


@pytest.mark.parametrize("case", ["qwen3_gqa2_hd20", "qwen3_yarn", "llama3_rope_scaling_tied"])
def test_real_model_keys_shift_to_their_new_positions(case, tmp_path_factory):
    """A segment's K through layer 0 (k_proj, k_norm if any, RoPE) at 0..n-1, shifted by Δ, equals K at Δ..Δ+n-1."""
    from nebula_engine.model.loader import load_model

    # same root as test_segments: each checkpoint is written once per session
    model, _, _ = load_model(str(build_checkpoint(CASES_BY_NAME[case], tmp_path_factory.getbasetemp())))
    attn = model.model.layers[0].self_attn
    token_ids = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(6))
    n, delta = token_ids.numel(), 131

    @torch.no_grad()
    def keys_at(positions: torch.Tensor) -> torch.Tensor:
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(token_ids))
        k = attn.k_proj(x).view(n, attn.num_kv_heads, attn.head_dim)  # [T, Hkv, D]
        return attn.rotary(positions, attn.k_norm(k) if attn.qk_norm else k)

    local = keys_at(torch.arange(n))
    shifted = shift_keys(local, delta, attn.rotary)
    torch.testing.assert_close(shifted, keys_at(torch.arange(n) + delta), atol=ATOL, rtol=0)
    assert not torch.allclose(local, keys_at(torch.arange(n) + delta), atol=1e-2)
