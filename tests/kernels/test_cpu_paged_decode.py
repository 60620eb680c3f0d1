"""The CPU paged-decode kernel against its torch reference (gather + SDPA), its input checks, and that it runs on
torch's own OpenMP runtime."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nebula_engine.kernels import cpu_paged_decode

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel with")


@pytest.fixture(scope="module", autouse=True)
def kernel_loaded():
    assert cpu_paged_decode.load(), "the kernel did not build on a machine with a C++ compiler (see the log)"


def _case(batch, heads, kv_heads, dim, v_dim, page_size, lengths, seed, garbage=float("nan")):
    """Caches whose every slot outside the sequences' contexts holds ``garbage``, scattered block tables."""
    generator = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page_size) for n in lengths) + 1
    num_pages = batch * max_pages + 3
    k_cache = torch.full((num_pages, page_size, kv_heads, dim), garbage)
    v_cache = torch.full((num_pages, page_size, kv_heads, v_dim), garbage)
    tables = torch.randperm(num_pages, generator=generator)[: batch * max_pages].view(batch, max_pages)
    for b, length in enumerate(lengths):
        for position in range(length):
            page, offset = tables[b, position // page_size], position % page_size
            k_cache[page, offset] = torch.randn(kv_heads, dim, generator=generator) * 2
            v_cache[page, offset] = torch.randn(kv_heads, v_dim, generator=generator)
    q = torch.randn(batch, heads, dim, generator=generator)
    return q, k_cache, v_cache, tables, torch.tensor(lengths)


@pytest.mark.parametrize("heads,kv_heads,dim,v_dim", [(9, 3, 64, 64), (8, 2, 128, 128), (4, 4, 24, 40), (6, 1, 16, 8)])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("window", [None, 1, 7, 1000])
def test_kernel_matches_gather_and_sdpa(heads, kv_heads, dim, v_dim, page_size, window):
    lengths = [1, page_size, page_size + 1, 3 * page_size - 1, 61]
    q, k_cache, v_cache, tables, seq_lens = _case(len(lengths), heads, kv_heads, dim, v_dim, page_size, lengths,
                                                  seed=heads * dim + page_size)
    ours = cpu_paged_decode.paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.3, window)
    expected = cpu_paged_decode.paged_decode_reference(q, k_cache, v_cache, tables, seq_lens, 0.3, window)
    assert not ours.isnan().any()  # no slot outside a context (all NaN here) was read
    # torch's own fp32 tolerances (atol 1e-5, rtol 1.3e-6): the kernel (-march=native, split over OpenMP threads)
    # sums in another order than SDPA, and in one fresh-clone CI run two of 5,120 elements differed by 2.4e-6
    torch.testing.assert_close(ours, expected)


def test_one_sequence_and_large_scores():
    """A single sequence (tasks only per KV head) with scores far apart: the online softmax rescales exactly."""
    q, k_cache, v_cache, tables, seq_lens = _case(1, 4, 2, 32, 32, 16, [200], seed=5)
    ours = cpu_paged_decode.paged_decode(q * 30, k_cache, v_cache, tables, seq_lens, 1.0)
    expected = cpu_paged_decode.paged_decode_reference(q * 30, k_cache, v_cache, tables, seq_lens, 1.0)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change,message", [
    (lambda t, n: (t, torch.tensor([0, 3])), "context length 0"),
    (lambda t, n: (t, torch.tensor([3, 99])), "outside its block table"),
    (lambda t, n: (t.index_fill(1, torch.tensor([0]), 10_000), n), "outside the pool"),
    (lambda t, n: (t.index_fill(1, torch.tensor([0]), -1), n), "outside the pool"),
])
def test_bad_block_tables_and_lengths_are_errors_not_reads(change, message):
    q, k_cache, v_cache, tables, seq_lens = _case(2, 4, 2, 8, 8, 4, [3, 6], seed=1)
    tables, seq_lens = change(tables, seq_lens)
    with pytest.raises(RuntimeError, match=message):
        cpu_paged_decode.paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.5)


def test_wrong_dtypes_and_shapes_are_errors():
    q, k_cache, v_cache, tables, seq_lens = _case(2, 4, 2, 8, 8, 4, [3, 6], seed=2)
    out = torch.empty(2, 4, 8)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.nebula_cpu.paged_decode(q.double(), k_cache, v_cache, tables, seq_lens, 0.5, 0, out)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.nebula_cpu.paged_decode(q, k_cache, v_cache, tables.int(), seq_lens, 0.5, 0, out)
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.nebula_cpu.paged_decode(q, k_cache, v_cache, tables[:1], seq_lens, 0.5, 0, out)


def test_usable_only_for_fp32_cpu_inference_when_switched_on():
    q, k_cache, v_cache, *_ = _case(1, 4, 2, 8, 8, 4, [3], seed=3)
    assert cpu_paged_decode.usable(q, k_cache, v_cache)
    assert not cpu_paged_decode.usable(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())
    assert not cpu_paged_decode.usable(q.requires_grad_(), k_cache, v_cache)
    previous = cpu_paged_decode.set_enabled(False)
    try:
        assert not cpu_paged_decode.usable(q.detach(), k_cache, v_cache)
    finally:
        cpu_paged_decode.set_enabled(previous)


def test_runs_on_torchs_openmp_runtime_only():
    """A second OpenMP runtime in the process (numba's, a system libgomp) fights torch's threads for the cores.
    Checked in a fresh interpreter: other tests' imports (sentencepiece bundles its own libgomp) do not count."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("no /proc/self/maps")
    probe = ("import torch, pathlib\n"
             "from nebula_engine.kernels import cpu_paged_decode\n"
             "assert cpu_paged_decode.load()\n"
             "maps = pathlib.Path('/proc/self/maps').read_text().splitlines()\n"
             "print(sorted({line.split()[-1] for line in maps if 'gomp' in line or 'iomp' in line}))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    runtimes = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    torch_lib = Path(torch.__file__).parent / "lib"
    assert all(Path(path).parent == torch_lib for path in runtimes), runtimes


def test_a_build_killed_midway_does_not_block_later_loads(tmp_path):
    """torch's lock file, left by a build that was killed, would make every later load wait forever."""
    from torch.utils import cpp_extension

    name = cpu_paged_decode._build_name()
    built = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    shutil.copytree(built, tmp_path / name)
    (tmp_path / name / "lock").touch()  # what a killed build leaves
    probe = "from nebula_engine.kernels import cpu_paged_decode\nassert cpu_paged_decode.load()\n"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / name / "lock").exists()
