"""Each Triton PIC kernel against its torch reference.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before any kernel module
is imported) on tiny shapes; with CUDA the same tests run compiled on the GPU. Half-precision caches are tested
everywhere, half-precision products only on the GPU (the interpreter's bf16 ``tl.dot`` is wrong).
Skipped where Triton is missing.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nebula_engine.kernels import pic_ops, triton_pic  # noqa: E402
from nebula_engine.kernels.gated_delta_rule import chunk_gated_delta_rule as torch_chunk_rule  # noqa: E402

DEVICE = "cpu" if triton_pic.interpreting() else "cuda"
HALF_DTYPES = [torch.bfloat16, torch.float16]
DOT_DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, *HALF_DTYPES]  # kernels with tl.dot
needs_triton = pytest.mark.skipif(not triton_pic.triton_available(), reason="triton missing, or no CUDA/interpreter")


def randn(*shape: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype=torch.float32) -> None:
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_kernels_refuse_clearly_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    assert not triton_pic.triton_available()
    with pytest.raises(RuntimeError, match="triton"):
        triton_pic.rotate_cached_keys  # noqa: B018


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_without_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_pic.triton_available()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        triton_pic.kv_deviation  # noqa: B018


# ---- rotate_cached_keys ------------------------------------------------------------------------------

ROTATIONS = [  # (row shape after the slot dim, rotary_dim, interleaved, col_offset)
    ((3, 16), 16, False, 0), ((2, 24), 8, False, 0), ((2, 16), 16, True, 0), ((20,), 8, True, 12), ((10,), 6, False, 4),
]


@needs_triton
@pytest.mark.parametrize("row,rotary_dim,interleaved,col_offset", ROTATIONS)
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
def test_rotate_matches_reference(row, rotary_dim, interleaved, col_offset, per_token, dtype):
    cache = randn(24, *row, seed=1, dtype=dtype)
    slots = torch.tensor([17, 3, 9, 4, 22], device=DEVICE)
    angles = randn(5 if per_token else 1, rotary_dim // 2, seed=2) * 3
    expected = cache.clone()
    pic_ops.rotate_cached_keys(expected, slots, angles.cos(), angles.sin(), rotary_dim, interleaved, col_offset)
    triton_pic.rotate_cached_keys(cache, slots, angles.cos(), angles.sin(), rotary_dim, interleaved, col_offset)
    close(cache, expected, dtype)


# ---- kv_deviation ------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("shape", [(7, 2, 8), (3, 1500), (1, 5), (0, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
def test_kv_deviation_matches_reference(shape, dtype):
    old, new = randn(*shape, seed=3, dtype=dtype), randn(*shape, seed=4, dtype=dtype)
    out = triton_pic.kv_deviation(old, new)
    assert out.dtype == torch.float32 and out.shape == (shape[0],)
    torch.testing.assert_close(out, pic_ops.kv_deviation(old, new), atol=1e-4, rtol=1e-5)


@needs_triton
def test_kv_deviation_of_a_strided_view():
    full_old, full_new = randn(6, 4, 10, seed=5), randn(6, 4, 10, seed=6)
    old, new = full_old[::2, :, 2:7], full_new[::2, :, 2:7]  # not contiguous
    torch.testing.assert_close(triton_pic.kv_deviation(old, new), pic_ops.kv_deviation(old, new), atol=1e-5, rtol=1e-5)


# ---- scattered_paged_attention -----------------------------------------------------------------------

ATTENTION_CASES = [  # (heads, kv_heads, head_dim, v_dim, page_size, seq_len, positions)
    (4, 4, 16, 16, 4, 23, [0, 3, 4, 9, 20, 21, 22]),
    (6, 2, 12, 20, 8, 40, [1, 2, 3, 17, 30, 39]),
    (2, 1, 32, 16, 16, 70, list(range(70))),  # more rows than one query block
    (4, 2, 16, 16, 4, 9, [8]),
]


@needs_triton
@pytest.mark.parametrize("heads,kv_heads,head_dim,v_dim,page_size,seq_len,positions", ATTENTION_CASES)
@pytest.mark.parametrize("window", [None, 5, 33])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_scattered_attention_matches_reference(heads, kv_heads, head_dim, v_dim, page_size, seq_len, positions,
                                               window, dtype):
    pages = -(-seq_len // page_size)
    k_cache = randn(pages + 3, page_size, kv_heads, head_dim, seed=7, dtype=dtype)
    v_cache = randn(pages + 3, page_size, kv_heads, v_dim, seed=8, dtype=dtype)
    table = torch.randperm(pages + 3, generator=torch.Generator().manual_seed(9))[:pages].to(DEVICE)
    q_positions = torch.tensor(positions, device=DEVICE)
    q = randn(len(positions), heads, head_dim, seed=10, dtype=dtype)
    args = (q, k_cache, v_cache, table, seq_len, q_positions, head_dim**-0.5, window)
    out = triton_pic.scattered_paged_attention(*args)
    assert out.shape == (len(positions), heads, v_dim) and out.dtype == dtype
    expected = pic_ops.scattered_paged_attention(*(x.float() if torch.is_tensor(x) and x.is_floating_point() else x
                                                   for x in args))
    close(out.float(), expected, dtype)


# ---- chunked gated delta rule ------------------------------------------------------------------------

def _gdn_inputs(tokens, heads, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1)
    v = torch.randn(tokens, heads, dv, generator=gen)
    g = -torch.rand(tokens, heads, generator=gen) * 0.2
    beta = torch.rand(tokens, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return [x.to(DEVICE) for x in (q, k, v, g, beta, state)]


GDN_CASES = [(1, 1, 16, 16, 16), (40, 2, 16, 8, 16), (37, 1, 12, 80, 32), (64, 2, 32, 16, 32)]  # T, H, dk, dv, C


@needs_triton
@pytest.mark.parametrize("tokens,heads,dk,dv,chunk", GDN_CASES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_rule_matches_reference(tokens, heads, dk, dv, chunk, with_state):
    q, k, v, g, beta, state = _gdn_inputs(tokens, heads, dk, dv, seed=tokens)
    initial = state if with_state else None
    out, final = triton_pic.chunk_gated_delta_rule(q, k, v, g, beta, initial, chunk_size=chunk)
    expected_out, expected_final = torch_chunk_rule(q, k, v, g, beta, initial, chunk_size=chunk)
    assert final.dtype == torch.float32 and out.dtype == v.dtype
    close(out, expected_out)
    close(final, expected_final)


@needs_triton
@pytest.mark.parametrize("tokens,heads,dk,chunk", [(0, 2, 16, 16), (5, 1, 16, 16), (45, 2, 16, 16), (33, 2, 24, 32)])
def test_transition_matches_reference(tokens, heads, dk, chunk):
    _, k, _, g, beta, _ = _gdn_inputs(tokens, heads, dk, 4, seed=tokens + 1)
    transition = triton_pic.gated_delta_transition(k, g, beta, chunk_size=chunk)
    close(transition, pic_ops.gated_delta_transition(k, g, beta, chunk_size=chunk))


@needs_triton
def test_chunk_rule_rejects_a_chunk_the_kernel_cannot_tile():
    _, k, _, g, beta, _ = _gdn_inputs(4, 1, 16, 16, seed=0)
    with pytest.raises(ValueError, match="chunk_size"):
        triton_pic.gated_delta_transition(k, g, beta, chunk_size=24)
