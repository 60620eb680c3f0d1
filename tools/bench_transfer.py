"""Throughput of reading scattered KV pages from another worker process through NIXL vs a local copy.

A source process holds a pool of --num-pages pages of --page-kib KiB, split over --num-tensors page-major
tensors (as a model's layers x (K, V) split it). This process holds a pool of the same layout, reads
--read-pages random pages of the source into random local pages with ``KVTransferAgent.read_pages``
(one request), and copies the same pages between two in-process pools with ``index_copy_`` (the local
limit). Prints medians over --repeats and their ratio, measured in the same run.

    python tools/bench_transfer.py --num-pages 2048 --page-kib 64 --num-tensors 8 --read-pages 1024
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np
import torch

from nebula_engine.cluster.runtime.transfer import KVTransferAgent

GIB = 1024**3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-pages", type=int, default=2048)
    parser.add_argument("--page-kib", type=int, default=64, help="bytes of one page over all tensors, KiB")
    parser.add_argument("--num-tensors", type=int, default=8, help="tensors the page is split over")
    parser.add_argument("--read-pages", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:i] for VRAM pools")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (args.page_kib * 1024) % (4 * args.num_tensors):
        parser.error("--page-kib KiB must split into --num-tensors whole fp32 rows")
    if not 0 < args.read_pages <= args.num_pages:
        parser.error("--read-pages must be in 1..--num-pages")
    return args


def make_pool(args: argparse.Namespace, fill: bool) -> list[torch.Tensor]:
    """Page p of tensor t holds t * num_pages + p everywhere (when ``fill``), zeros otherwise."""
    width = args.page_kib * 1024 // (4 * args.num_tensors)
    pages = torch.arange(args.num_pages, dtype=torch.float32, device=args.device)[:, None]
    return [(pages + t * args.num_pages).expand(-1, width).contiguous() if fill
            else torch.zeros(args.num_pages, width, device=args.device) for t in range(args.num_tensors)]


def serve_source(conn, args: argparse.Namespace) -> None:
    pool = make_pool(args, fill=True)
    if pool[0].is_cuda:
        torch.cuda.synchronize(pool[0].device)
    with KVTransferAgent("source", pool) as agent:
        conn.send(agent.metadata())
        conn.recv()  # any message: the benchmark is over


def median_seconds(run, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_pages(pool: list[torch.Tensor], local: np.ndarray, remote: np.ndarray, num_pages: int) -> None:
    for t, tensor in enumerate(pool):
        want = torch.as_tensor(remote + t * num_pages, dtype=torch.float32, device=tensor.device)
        if not torch.equal(tensor[torch.as_tensor(local, device=tensor.device)][:, 0], want):
            raise AssertionError(f"tensor {t}: pages read do not hold the source's values")


def bench_nixl(args: argparse.Namespace, remote: np.ndarray, local: np.ndarray) -> float:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    source = ctx.Process(target=serve_source, args=(child, args), daemon=True)
    source.start()
    try:
        if not conn.poll(120):
            raise TimeoutError("the source process did not start in 120 s")
        pool = make_pool(args, fill=False)
        with KVTransferAgent("reader", pool) as agent:
            agent.add_peer("source", conn.recv())
            agent.read_pages("source", remote.tolist(), local.tolist())  # warm-up: connects, checks content
            check_pages(pool, local, remote, args.num_pages)
            return median_seconds(lambda: agent.read_pages("source", remote.tolist(), local.tolist()),
                                  args.repeats, pool[0].device)
    finally:
        conn.send("done")
        source.join(10)
        if source.is_alive():
            source.kill()


def bench_local(args: argparse.Namespace, remote: np.ndarray, local: np.ndarray) -> float:
    src, dst = make_pool(args, fill=True), make_pool(args, fill=False)
    src_idx = torch.as_tensor(remote, device=args.device)
    dst_idx = torch.as_tensor(local, device=args.device)

    def copy() -> None:
        for s, d in zip(src, dst):
            d.index_copy_(0, dst_idx, s.index_select(0, src_idx))

    copy()
    check_pages(dst, local, remote, args.num_pages)
    return median_seconds(copy, args.repeats, src[0].device)


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(args.seed)
    remote = rng.choice(args.num_pages, args.read_pages, replace=False)
    local = rng.choice(args.num_pages, args.read_pages, replace=False)
    moved = args.read_pages * args.page_kib * 1024
    nixl_s = bench_nixl(args, remote, local)
    local_s = bench_local(args, remote, local)
    print(f"{args.read_pages} scattered pages of {args.page_kib} KiB over {args.num_tensors} tensors "
          f"({moved / 2**20:.0f} MiB, {args.device}), median of {args.repeats}:")
    print(f"  NIXL read from another process: {nixl_s * 1e3:8.2f} ms  {moved / nixl_s / GIB:6.2f} GiB/s")
    print(f"  in-process index_copy_:         {local_s * 1e3:8.2f} ms  {moved / local_s / GIB:6.2f} GiB/s")
    print(f"  NIXL / local throughput: {local_s / nixl_s:.2f}")


if __name__ == "__main__":
    main()
