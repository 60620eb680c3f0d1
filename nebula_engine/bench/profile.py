"""`nebula-engine profile`: measure this engine on this machine and write a profile the simulator reads.

What is measured, each through the engine's own code path:
- prefill: ``LLM.generate`` of fresh prompts (no cache hit, one output token) at several lengths, on one torch
  thread, timed in CPU seconds (least of several runs: robust to whatever else the machine runs); fitted to
  ``fixed_s + per_token_s * n + attention_s * n^2 / 2`` (least squares). On a CPU the profile says how many cores
  the workers' forwards share (``node_cores``);
- combine cost per PIC backend: a prompt of cached segments (prefilled earlier, now reused at new
  positions behind a fresh lead-in) plus a fresh query, timed like the prefill; the cost is that time over
  a plain prefill of the same prompt (PIC off): 1.0 = recomputing it;
- KV transfer: page-scattered reads of the engine's own page layout, with NIXL from another process
  over loopback where NIXL imports, else an in-process copy (the profile says which); fitted to
  latency + bytes / bandwidth;
- host tier: writing host copies back into the pool (the host tier's promotion path);
- disk tier: reading entries back through the disk tier (file, checksum, deserialize).

The profile describes one machine running every worker (``shared_compute``: concurrent forwards share
its processors), with the cache sizes and batch budget of the engine options given.
"""

from __future__ import annotations

import multiprocessing as mp
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from nebula_engine.cluster.control.config import ClusterProfile, PrefillTimeModel, TransferLink
from nebula_engine.devices import machine_cores

ATTENTION_BACKENDS = ("full", "naive", "epic", "cacheblend", "a3", "prophet")
HYBRID_BACKENDS = ("hypic",)
PLAIN = "plain prefill"
TRANSFER_PAGES = (1, 4, 16, 64, 256)
LOWEST_TOKEN_ID = 100  # clear of special tokens, as the benchmarks' synthetic prompts


@dataclass(frozen=True)
class ProfileOptions:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int = 2048
    host_cache_tokens: int = 0
    max_num_batched_tokens: int = 2048
    lengths: tuple[int, ...] = (16, 64, 256, 512, 1024, 1536)
    repeats: int = 3
    num_segments: int = 4
    segment_len: int = 256
    query_len: int = 32
    backends: tuple[str, ...] | None = None  # None: every backend the model supports
    transfer: str = "auto"  # auto (NIXL if it imports) | nixl | copy
    seed: int = 0


def cpu_seconds(run: Callable[[], object], repeats: int) -> float:
    """Least CPU time of this process over ``repeats`` runs. The probe runs torch on one thread, so this is the
    work the machine must do, whatever other processes do meanwhile (wall time under a loaded machine is not)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return min(times)


def wall_seconds(run: Callable[[], object], repeats: int) -> float:
    """Fastest wall time of ``repeats`` runs (for transfers, which wait on another process)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


class EngineProbe:
    """One engine and a source of fresh token ids."""

    def __init__(self, options: ProfileOptions):
        from nebula_engine import LLM, SamplingParams

        self.options = options
        torch.set_num_threads(1)  # CPU time of one thread = the work; the profile spreads it over the cores
        self.llm = LLM(options.model, dtype=options.dtype, device=options.device, page_size=options.page_size,
                       num_pages=options.num_pages, max_num_batched_tokens=options.max_num_batched_tokens)
        self.engine = self.llm.llm_engine
        self.params = SamplingParams(max_tokens=1, temperature=0.0)
        self.vocab = self.engine.model_config.vocab_size
        self.rng = np.random.default_rng(options.seed)

    def fresh(self, length: int) -> list[int]:
        return self.rng.integers(LOWEST_TOKEN_ID, self.vocab, size=length).tolist()

    def generate(self, prompt: dict, pic_backend) -> None:
        self.llm.generate(prompt, self.params, pic_backend=pic_backend)

    def supported_backends(self) -> tuple[str, ...]:
        from nebula_engine.pic.backends import resolve_pic_backend

        if self.engine.model_runner.pic_executor is None:
            return ()
        wanted = self.options.backends or (HYBRID_BACKENDS + ATTENTION_BACKENDS)
        usable = []
        for name in dict.fromkeys(wanted):
            try:
                resolve_pic_backend(name, self.engine.model_runner.model)
            except ValueError:
                continue
            usable.append(name)
        return tuple(usable)

    def kv_bytes_per_token(self) -> int:
        storage = self.engine.model_runner.kv_storage
        return sum(t[0].numel() * t.element_size() for layer in storage.layer_caches for t in layer) // storage.page_size


# ---- prefill ---------------------------------------------------------------------------------------
def measure_prefill(probe: EngineProbe) -> list[tuple[int, float]]:
    """(prompt tokens, best seconds) of cold prefills, one output token, PIC off."""
    limit = probe.engine.max_model_len - 1
    samples = []
    for length in sorted({min(n, limit) for n in probe.options.lengths}):
        probe.generate({"prompt_token_ids": probe.fresh(length)}, None)  # warm-up at this shape
        seconds = cpu_seconds(lambda n=length: probe.generate({"prompt_token_ids": probe.fresh(n)}, None),
                              probe.options.repeats)
        samples.append((length, seconds))
    return samples


def fit_prefill(samples: list[tuple[int, float]]) -> PrefillTimeModel:
    """Least squares over [1, n, n^2 / 2]; a term that fits negative is dropped and the rest refitted."""
    n = np.array([s[0] for s in samples], dtype=np.float64)
    t = np.array([s[1] for s in samples], dtype=np.float64)
    columns = {"fixed_s": np.ones_like(n), "per_token_s": n, "attention_s": n * n / 2}
    active = list(columns)
    while True:
        solution, *_ = np.linalg.lstsq(np.stack([columns[c] for c in active], axis=1), t, rcond=None)
        fitted = dict(zip(active, solution.tolist()))
        negative = [c for c in active if fitted[c] < 0]
        if not negative or len(active) == 1:
            break
        active.remove(negative[0])
    return PrefillTimeModel(**{c: max(0.0, fitted.get(c, 0.0)) for c in columns})


# ---- combine cost per backend ----------------------------------------------------------------------
def combine_prompt(lead: list[int], segments: list[list[int]], query: list[int]) -> dict:
    return {"segments": [("regular", lead), *(("pic", s) for s in segments), ("regular", query)]}


def measure_combine(probe: EngineProbe, backend: str | None) -> dict:
    """Least CPU time of a combine with every segment cached (reused behind a fresh lead-in, in a new order);
    ``backend`` None: the same prompt prefilled plainly, PIC off (the unit of the combine costs)."""
    options = probe.options
    segments = [probe.fresh(options.segment_len) for _ in range(options.num_segments)]
    probe.generate(combine_prompt(probe.fresh(8), segments, probe.fresh(options.query_len)), backend)  # caches them

    def run() -> None:  # a fresh lead-in and order: no prefix hit, every segment re-rotated
        order = probe.rng.permutation(len(segments)).tolist()
        probe.generate(combine_prompt(probe.fresh(8), [segments[i] for i in order], probe.fresh(options.query_len)),
                       backend)

    run()  # warm-up
    return {"backend": backend or PLAIN, "seconds": cpu_seconds(run, options.repeats),
            "reused_tokens": options.num_segments * options.segment_len, "fresh_tokens": 8 + options.query_len}


def combine_costs(rows: list[dict]) -> dict[str, float]:
    """Each backend's combine time over a plain prefill of the same prompt (PIC off): the share of a recompute a
    reused PIC token still costs. A ratio of two times measured alike carries over between machines better than
    either time."""
    plain = next(row["seconds"] for row in rows if row["backend"] == PLAIN)
    return {row["backend"]: round(row["seconds"] / plain, 4) for row in rows if row["backend"] != PLAIN}


def measure_combines(probe: EngineProbe) -> list[dict]:
    """The plain prefill, then every backend the model supports."""
    backends = probe.supported_backends()
    return [measure_combine(probe, backend) for backend in (None, *backends)] if backends else []


# ---- KV transfer -----------------------------------------------------------------------------------
def pool_shapes(probe: EngineProbe) -> list[tuple[tuple[int, ...], str]]:
    storage = probe.engine.model_runner.kv_storage
    return [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for layer in storage.layer_caches for t in layer]


def make_pool(shapes: list[tuple[tuple[int, ...], str]], num_pages: int) -> list[torch.Tensor]:
    return [torch.zeros((num_pages, *shape[1:]), dtype=getattr(torch, dtype)) for shape, dtype in shapes]


def serve_pool(conn, shapes, num_pages: int) -> None:
    """Source process: a pool of the engine's layout behind a NIXL agent, until told to stop."""
    from nebula_engine.cluster.runtime.transfer import KVTransferAgent

    with KVTransferAgent("profile-source", make_pool(shapes, num_pages)) as agent:
        conn.send(agent.metadata())
        conn.recv()


def measure_nixl(shapes, num_pages: int, repeats: int) -> list[tuple[int, float]]:
    """(pages, best seconds) of page-scattered NIXL reads from another process over loopback."""
    from nebula_engine.cluster.runtime.transfer import KVTransferAgent

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    source = ctx.Process(target=serve_pool, args=(child, shapes, num_pages), daemon=True)
    source.start()
    try:
        if not conn.poll(120):
            raise TimeoutError("the NIXL source process did not start in 120 s")
        with KVTransferAgent("profile-reader", make_pool(shapes, num_pages)) as agent:
            agent.add_peer("profile-source", conn.recv())
            return page_reads(lambda pages: agent.read_pages("profile-source", pages, pages, 10.0), num_pages,
                              repeats)
    finally:
        conn.send("stop")
        source.join(10)
        if source.is_alive():
            source.kill()


def measure_copy(shapes, num_pages: int, repeats: int) -> list[tuple[int, float]]:
    """(pages, best seconds) of an in-process page copy between two pools of the engine's layout."""
    src, dst = make_pool(shapes, num_pages), make_pool(shapes, num_pages)

    def copy(pages: list[int]) -> None:
        index = torch.tensor(pages)
        for s, d in zip(src, dst):
            d.index_copy_(0, index, s.index_select(0, index))

    return page_reads(copy, num_pages, repeats, cpu_seconds)


def page_reads(read: Callable[[list[int]], object], num_pages: int, repeats: int,
               timer: Callable = wall_seconds) -> list[tuple[int, float]]:
    rng = np.random.default_rng(0)
    samples = []
    for count in (c for c in TRANSFER_PAGES if c <= num_pages):
        pages = rng.choice(num_pages, count, replace=False).tolist()
        read(pages)  # warm-up (connects on the first NIXL read)
        samples.append((count, timer(lambda: read(pages), repeats)))
    return samples


def fit_link(samples: list[tuple[float, float]]) -> TransferLink:
    """Least squares of seconds = latency + bytes / bandwidth over (bytes, seconds)."""
    x = np.array([s[0] for s in samples], dtype=np.float64)
    t = np.array([s[1] for s in samples], dtype=np.float64)
    (latency, per_byte), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), t, rcond=None)
    if per_byte <= 0:  # flat in size: no bandwidth limit visible at these sizes
        per_byte = t.max() / x.max()
    return TransferLink(bandwidth_bytes_per_s=float(1.0 / per_byte), latency_s=float(max(0.0, latency)))


def measure_host_load(probe: EngineProbe) -> list[tuple[int, float]]:
    """(pages, best seconds) of writing host copies back into the pool (``StoragePageIO.write_pages``)."""
    from nebula_engine.kvcache.page_io import StoragePageIO

    io = StoragePageIO(probe.engine.model_runner.kv_storage)
    num_pages = probe.engine.model_runner.kv_storage.num_pages
    copies = {}

    def write(pages: list[int]) -> None:
        key = tuple(pages)
        if key not in copies:
            copies[key] = io.read_pages(pages)
        io.write_pages(pages, copies[key])

    return page_reads(write, num_pages, probe.options.repeats, cpu_seconds)


def measure_disk_load(probe: EngineProbe) -> list[tuple[int, float]]:
    """(pages, best seconds) of reading entries back through the disk tier (checked, deserialized)."""
    from nebula_engine.kvcache.disk_tier import DiskTier
    from nebula_engine.kvcache.page_io import StoragePageIO

    io = StoragePageIO(probe.engine.model_runner.kv_storage)
    page_size, samples = probe.options.page_size, []
    with tempfile.TemporaryDirectory(prefix="nebula-profile-disk-") as root:
        tier = DiskTier(root, capacity_tokens=1 << 40)
        try:
            for count in TRANSFER_PAGES:
                key = f"pages-{count}"
                tier.put("pic", key, count * page_size, {"pages": io.read_pages(list(range(count)))})
                tier.flush()
                tier.get("pic", key)  # warm-up
                samples.append((count, wall_seconds(lambda k=key: tier.get("pic", k), probe.options.repeats)))
        finally:
            tier.close()
    return samples


# ---- the profile -----------------------------------------------------------------------------------
def measure_transfer(probe: EngineProbe) -> tuple[str, list[tuple[int, float]]]:
    from nebula_engine.cluster.runtime.transfer import nixl_available

    mode = probe.options.transfer
    if mode == "nixl" and not nixl_available():
        raise RuntimeError("--transfer nixl: NIXL is not installed here")
    if mode == "auto":
        mode = "nixl" if nixl_available() else "copy"
    shapes, pages = pool_shapes(probe), min(probe.options.num_pages, 512)
    measure = measure_nixl if mode == "nixl" else measure_copy
    return mode, measure(shapes, pages, probe.options.repeats)


def build_profile(options: ProfileOptions, log: Callable[[str], None] = lambda line: None) -> dict:
    probe = EngineProbe(options)
    bytes_per_token, page_size = probe.kv_bytes_per_token(), options.page_size
    log(f"model {options.model}: {bytes_per_token} KV bytes per token on {options.device} ({options.dtype})")
    prefill_samples = measure_prefill(probe)
    prefill = fit_prefill(prefill_samples)
    log(f"prefill: {prefill}")
    combines = measure_combines(probe)
    costs = combine_costs(combines) if combines else {}
    for row in combines:
        log(f"combine {row['backend']}: {row['seconds'] * 1e3:.1f} ms -> {costs.get(row['backend'], 1.0):.3f} "
            "of a plain prefill")
    mode, transfer_samples = measure_transfer(probe)
    to_bytes = lambda samples: [(pages * page_size * bytes_per_token, s) for pages, s in samples]  # noqa: E731
    link = fit_link(to_bytes(transfer_samples))
    host, disk = fit_link(to_bytes(measure_host_load(probe))), fit_link(to_bytes(measure_disk_load(probe)))
    log(f"transfer ({mode}): {link}; host tier: {host}; disk tier: {disk}")
    engine_backend = probe.engine.pic_backend.name if probe.engine.pic_backend is not None else "full"
    if costs and engine_backend not in costs:  # --backend left the default out: the profile runs what it measured
        engine_backend = next(name for name in costs)
    profile = ClusterProfile(
        name=f"measured-{platform.node() or 'host'}", prefill=prefill, kv_bytes_per_token=bytes_per_token,
        intra_node=link, inter_node=link, host_load=host, disk_load=disk, gpus_per_node=1 << 10,
        cache_capacity_tokens=options.num_pages * page_size, host_capacity_tokens=options.host_cache_tokens,
        max_batch_tokens=options.max_num_batched_tokens, pic_backend=engine_backend,
        combine_cost=costs or {engine_backend: 1.0},
        shared_compute=options.device == "cpu", node_cores=machine_cores() if options.device == "cpu" else 1,
        sources=sources(options, mode, prefill_samples, combines, transfer_samples))
    return profile.to_dict()


def sources(options: ProfileOptions, mode: str, prefill_samples, combines, transfer_samples) -> dict:
    how = "NIXL page-scattered reads from another process over loopback" if mode == "nixl" else \
        "in-process page copy (NIXL unavailable)"
    return {
        "measured": f"nebula-engine profile on {platform.node()} ({platform.processor() or platform.machine()}, "
                    f"{torch.get_num_threads()} torch threads), {time.strftime('%Y-%m-%d %H:%M')}",
        "model": f"{options.model} ({options.dtype}, {options.device})",
        "prefill": "least-squares fit of LLM.generate (cold prompt, 1 output token, PIC off) on one torch thread, "
                   f"least CPU time of {options.repeats} (single-core seconds: what the work costs, whatever else runs "
                   "here); samples (tokens, s): {[(n, round(s, 5)) for n, s in prefill_samples]}",
        "combine_cost": f"{options.num_segments} cached segments x {options.segment_len} + {options.query_len}-token "
                        "query behind a fresh 8-token lead-in, CPU time over a plain prefill's (single-core ms): "
                        + "; ".join(f"{r['backend']} {r['seconds'] * 1e3:.1f}" for r in combines),
        "intra_node": f"{how}; samples (pages, s): {[(p, round(s, 6)) for p, s in transfer_samples]}",
        "inter_node": "the same link: every worker of this profile runs on this one machine",
        "host_load": "StoragePageIO.write_pages of host copies into the pool (the host tier's promotion), "
                     "single-core CPU time",
        "disk_load": "DiskTier.get of entries written by DiskTier.put (checksum + deserialize)",
        "gpus_per_node": "one machine holds every worker",
        "cache_capacity_tokens": f"engine pool: {options.num_pages} pages x {options.page_size} tokens",
        "host_capacity_tokens": "engine option host_cache_tokens",
        "max_batch_tokens": "engine option max_num_batched_tokens",
        "pic_backend": "the engine's default backend for this model ('auto'), or the first one measured when "
                       "--backend leaves the default out",
        "shared_compute": "CPU: the workers' processes share this machine's cores" if options.device == "cpu"
        else "one device per worker",
        "node_cores": "cores of this machine the workers' forwards share (each forward uses all cores when alone: "
                      "intra-op threads assumed to scale perfectly)",
        "transfer": mode,
    }


def write_profile(data: dict, path: Path) -> None:
    import json

    ClusterProfile.from_dict(data)  # what the simulator will read must load
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
