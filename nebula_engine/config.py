"""Frozen configuration of one engine: model source, KV cache, scheduler.

``EngineConfig.create(model, **kwargs)`` routes each keyword to the sub-config that declares it, so
front ends (``LLM``, CLI, server) pass flat keyword arguments and new options only touch one class.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from nebula_engine.catalog import DEFAULT_MODEL, resolve_model
from nebula_engine.model.config import ModelConfig

__all__ = ["DEFAULT_MODEL", "CacheConfig", "EngineConfig", "ModelConfig", "SchedulerConfig", "resolve_model"]

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # explicit pool size; None => derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True  # off automatically for models with linear-attention layers
    eviction_policy: str = "soft-share"  # PC vs PIC under pool pressure: soft-share | unified-lru | fixed-partition
    pc_share: float = 0.5  # p of paper eq. 2: target PC share of cached tokens (fixed-partition: hard share)
    worker_id: int = 0  # stamped on cache events
    host_cache_tokens: int = 0  # host-memory tier below the device pool; 0 = none
    disk_cache_tokens: int = 0  # local-disk tier below host memory; 0 = none
    disk_cache_path: str | None = None  # the disk tier's directory, reused across restarts
    demote_on_evict: bool = True  # an entry evicted from a tier moves down instead of being dropped

    def __post_init__(self) -> None:
        _require_positive(page_size=self.page_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes)
        if self.disk_cache_tokens and not self.disk_cache_path:
            raise ValueError("disk_cache_tokens needs disk_cache_path")
        if not 0.0 <= self.pc_share <= 1.0:
            raise ValueError(f"pc_share must be in [0, 1], got {self.pc_share!r}")
        if self.num_pages is not None:
            _require_positive(num_pages=self.num_pages)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # new tokens in one step; longer prompts are chunked
    max_model_len: int | None = None  # None => the model's max_position_embeddings

    def __post_init__(self) -> None:
        _require_positive(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _require_positive(max_model_len=self.max_model_len)


@dataclass(frozen=True)
class EngineConfig:
    model: str  # checkpoint directory, .gguf file, catalog name (resolved to its file) or Hugging Face hub id
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"  # "auto": flashinfer on CUDA when installed, else torch
    seed: int = 0  # seeds requests that carry no seed of their own
    # PIC backend spec for prompts with <pic> segments: "auto" (hypic for hybrid models, else prophet), a
    # name ("full", "naive", "epic", "cacheblend", "a3", "prophet", "hypic"), "name:option=value,...", or None (PIC off)
    pic_backend: str | None = "auto"
    revision: str | None = None  # hub id's branch, tag or commit; an error for a local path (it has no revisions)
    tokenizer: str | None = None  # tokenizer directory or hub id; None => the model's own
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs carry no text (vLLM's option)
    download: bool = False  # a catalog name (``qwen2.5-coder-0.5b``) whose file is absent is fetched, not refused
    # replaces the checkpoint's chat template: a file, or the Jinja text itself (vLLM's --chat-template)
    chat_template: str | None = None
    # a GGUF file's quantized weights on CPU: "gguf" computes with their blocks, "float32" dequantizes at load
    quantization: str = "gguf"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        from nebula_engine.devices import check_device  # imports torch: not at module load

        check_device(self.device)
        object.__setattr__(self, "model", resolve_model(self.model, download=self.download))

    @classmethod
    def create(cls, model: str, **kwargs) -> EngineConfig:
        """Build from flat keyword arguments, each routed to the (sub-)config that declares it."""
        sections = {"cache": CacheConfig, "scheduler": SchedulerConfig}
        own = {f.name for f in fields(cls)} - set(sections)
        routed: dict[str, dict] = {name: {} for name in sections}
        top: dict = {}
        for key, value in kwargs.items():
            owner = next((s for s, c in sections.items() if key in {f.name for f in fields(c)}), None)
            if owner is not None:
                routed[owner][key] = value
            elif key in own:
                top[key] = value
            else:
                raise TypeError(f"unknown engine option {key!r}")
        return cls(model=str(model), **top, **{s: sections[s](**routed[s]) for s in sections})


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
