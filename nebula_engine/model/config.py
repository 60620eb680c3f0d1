"""Model configuration parsed from a Hugging Face ``config.json``.

Accepts both the transformers-v5 layout (``rope_parameters``) and the legacy one
(``rope_theta`` / ``rope_scaling`` at top level).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

_REQUIRED = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# families whose every layer is MoE: config.json has no dense ``intermediate_size``
_NO_DENSE_MLP = ("qwen3_5_moe", "qwen3_5_moe_text")
# transformers' default partial_rotary_factor where config.json may omit it (Qwen3.5 rotates 1/4 of each head)
_DEFAULT_PARTIAL_ROTARY = {"qwen3_5_text": 0.25, "qwen3_5_moe_text": 0.25}
_ROPE_TYPES = ("linear", "yarn", "llama3", "freq_factors")


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of RoPE.

    ``linear`` (position interpolation), ``yarn``, ``llama3`` (Llama 3.1: long wavelengths divided by
    ``factor``, a smooth ramp between ``low_freq_factor`` and ``high_freq_factor``), or ``freq_factors``:
    each ``inv_freq_i`` divided by ``freq_factors[i]``, the form llama.cpp stores llama3 scaling in a GGUF.
    """

    type: str
    factor: float
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None => derived from factor / mscale (YaRN)
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rotary_dim: int  # leading dims of each head that are rotated (partial rotary if < head_dim)
    style: str = "neox"  # "neox": pairs (i, i + r/2); "interleaved": pairs (2i, 2i + 1)
    scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.style not in ("neox", "interleaved"):
            raise ValueError(f"unknown RoPE style {self.style!r}; expected 'neox' or 'interleaved'")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {self.rotary_dim}")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None
    # MoE (Qwen3-MoE naming); num_experts == 0 means dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # the parsed config.json, for family-specific fields added by later families
    hf_config: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | Path, rope_style: str = "neox") -> ModelConfig:
        """Build from a config.json dict, a path to config.json, or a checkpoint directory."""
        raw = _with_default_partial_rotary(_text_part(_read_config(config)))
        missing = [key for key in _REQUIRED if raw.get(key) is None]
        if missing:
            raise ValueError(f"config.json is missing required field(s): {', '.join(missing)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu' is implemented")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        intermediate = raw.get("intermediate_size")
        if intermediate is None and raw["model_type"] in _NO_DENSE_MLP:
            intermediate = 0
        if intermediate is None:
            raise ValueError("config.json is missing required field(s): intermediate_size")
        return cls(
            model_type=raw["model_type"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=parse_rope(raw, head_dim, rope_style),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            hidden_act=raw.get("hidden_act", "silu"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_int_tuple(raw.get("eos_token_id")),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            num_experts=raw.get("num_experts") or raw.get("num_local_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
            moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            hf_config=raw,
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen-MoE rule: sparse every ``decoder_sparse_step`` layers, except ``mlp_only_layers``."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


def _read_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    return json.loads(path.read_text())


def _text_part(raw: dict[str, Any]) -> dict[str, Any]:
    """A vision-language wrapper's (Qwen3.5: ``qwen3_5``) ``text_config``, else ``raw`` unchanged.

    Top-level fields the wrapper keeps for the whole model (tied embeddings) override the text part's.
    """
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        return raw
    merged = {**text, "model_type": text.get("model_type") or raw["model_type"]}
    if "tie_word_embeddings" in raw:
        merged["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return merged


def _with_default_partial_rotary(raw: dict[str, Any]) -> dict[str, Any]:
    default = _DEFAULT_PARTIAL_ROTARY.get(raw.get("model_type"))
    given = "partial_rotary_factor" in raw or "partial_rotary_factor" in (raw.get("rope_parameters") or {})
    return raw if default is None or given else {**raw, "partial_rotary_factor": default}


def _as_int_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_rope(raw: Mapping[str, Any], head_dim: int, style: str = "neox") -> RopeConfig:
    """RoPE settings from either ``rope_parameters`` (v5) or ``rope_theta``/``rope_scaling`` (legacy)."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return RopeConfig(
        theta=float(theta),
        rotary_dim=int(head_dim * partial),
        style=style,
        scaling=_parse_scaling(rope_type, params, raw),
    )


def _parse_scaling(rope_type: str, params: Mapping[str, Any], raw: Mapping[str, Any]) -> RopeScaling | None:
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, {', '.join(_ROPE_TYPES)}")
    if rope_type == "linear":
        return RopeScaling(type="linear", factor=float(params["factor"]))
    if rope_type == "freq_factors":
        return RopeScaling(type="freq_factors", factor=1.0,
                           freq_factors=tuple(float(f) for f in params["freq_factors"]))
    if rope_type == "llama3":
        return RopeScaling(
            type="llama3",
            factor=float(params["factor"]),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings")
                                                 or raw["max_position_embeddings"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
        )
    original_max = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    factor = params.get("factor") or raw["max_position_embeddings"] / original_max
    return RopeScaling(
        type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(original_max),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
