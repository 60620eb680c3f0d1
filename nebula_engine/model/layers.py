"""Blocks shared by every model family.

Legend: T = tokens in the flattened batch, Hd = hidden size, H = query heads, Hkv = KV heads,
D = head dim, I = MLP width, E = experts, k = experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nebula_engine.kernels import cpu_row_ops
from nebula_engine.kernels.attention import AttentionContext
from nebula_engine.kernels.cpu_linear import Linear, linear
from nebula_engine.kernels.quant_linear import QuantizedWeight, StackedQuantizedWeight
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.rotary import RotaryEmbedding


@torch.no_grad()
def fuse_linear_weights(*linears: nn.Linear) -> tuple[torch.Tensor | StackedQuantizedWeight, torch.Tensor | None]:
    """One weight [sum of out features, in] (and bias) whose row slices become the linears' own parameters.

    Names, shapes and values of the parameters stay as they were (checkpoints load into the slices), and
    one matmul computes every projection of the same input: a decode step then reads each weight once
    with one kernel launch instead of one per projection (what vLLM's ``QKVParallelLinear`` and
    ``MergedColumnParallelLinear`` do).

    Children that compute with GGUF blocks (``QuantizedWeight``) keep them: the fused weight is then the stack of
    the children's weights, read in place (each row is whole blocks, so rows stack), any fp32 child joining it as
    F32 rows. The bias is fused the same way in both cases.
    """
    weights = [child.weight for child in linears]
    has_bias = [child.bias is not None for child in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("fused projections must all have a bias or all have none")
    bias = torch.cat([child.bias for child in linears]) if all(has_bias) else None
    quantized = any(isinstance(w, QuantizedWeight) for w in weights)
    if quantized:
        weight = StackedQuantizedWeight(tuple(w if isinstance(w, QuantizedWeight) else QuantizedWeight.from_float(w)
                                              for w in weights))
    else:
        weight = torch.cat(weights)
    start = 0
    for child in linears:
        rows = slice(start, start + child.out_features)
        if not quantized:
            child.weight = nn.Parameter(weight[rows], requires_grad=child.weight.requires_grad)
        if bias is not None:
            child.bias = nn.Parameter(bias[rows], requires_grad=child.bias.requires_grad)
        start += child.out_features
    return weight, bias


class FusedProjections(nn.Module):
    """Base of modules that apply several ``nn.Linear`` children to one input with a single matmul.

    ``fuse(name, *linears)`` keeps ``self.<name>_weight`` / ``<name>_bias`` (plain attributes: not in the
    state dict, whose names stay Hugging Face's). ``.to()`` and friends give each parameter new storage,
    so the fusion is rebuilt after them; ``refuse`` rebuilds it after children took quantized weights.
    """

    def __init__(self):
        super().__init__()
        self._fused: dict[str, tuple[str, ...]] = {}

    def fuse(self, name: str, *child_names: str) -> None:
        self._fused[name] = child_names
        children = [getattr(self, child) for child in child_names]
        weight, bias = fuse_linear_weights(*children)
        for child in children:
            child.fused = True
        setattr(self, f"{name}_weight", weight)
        setattr(self, f"{name}_bias", bias)

    def linear_weights(self) -> tuple[torch.Tensor | StackedQuantizedWeight, ...]:
        """The fused weights (``cpu_linear.prepack``); the children's slices are not used on their own."""
        return tuple(getattr(self, f"{name}_weight") for name in self._fused)

    def refuse(self) -> None:
        """Rebuild every fused weight from the children's current ones."""
        for name, child_names in self._fused.items():
            self.fuse(name, *child_names)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.refuse()
        return self


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x²) + eps) * w`` in fp32; ``zero_centered`` multiplies by ``(1 + w)`` (Qwen3.5).

    fp32 CPU input takes one op of ``cpu_row_ops``, other fp32 input ``F.rms_norm``: the same formula in one call
    instead of six ops.
    """

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def _row_op_takes(self, x: torch.Tensor) -> bool:
        return not self.zero_centered and x.is_contiguous() and cpu_row_ops.usable(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._row_op_takes(x):
            return cpu_row_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and not self.zero_centered:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class RopeAttention(FusedProjections):
    """Multi-head attention with GQA, RoPE and optional per-head QK-norm (Qwen3).

    ``output_gate`` (Qwen3.5): q_proj also yields a per-head gate; the output is ``out * sigmoid(gate)``
    before o_proj. ``zero_centered_norm`` makes the QK-norms multiply by ``(1 + w)``. ``qkv_bias`` (Qwen2) puts a
    bias on q/k/v alone; by default ``config.attention_bias`` decides for all four projections (Llama).

    ``attn_layer_idx`` is this layer's index among the model's attention layers, i.e. into
    ``AttentionContext.kv_caches`` (not the decoder-layer index, which differs in hybrid models).
    """

    latent_rope_dim: int | None = None  # caches K and V, not a latent (see ``MLAttention.latent_rope_dim``)

    def __init__(self, config: ModelConfig, attn_layer_idx: int, qk_norm: bool = False, output_gate: bool = False,
                 zero_centered_norm: bool = False, sliding_window: int | None = None, qkv_bias: bool | None = None):
        super().__init__()
        self.attn_layer_idx = attn_layer_idx
        self.sliding_window = sliding_window
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.v_head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.output_gate = output_gate
        bias = config.attention_bias
        in_bias, out_bias = (bias, bias) if qkv_bias is None else (qkv_bias, False)
        q_width = self.num_heads * self.head_dim * (2 if output_gate else 1)
        self.q_proj = Linear(config.hidden_size, q_width, bias=in_bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=in_bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=in_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=out_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered_norm)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered_norm)
        self.rotary = RotaryEmbedding(config.rope)
        self.fuse("qkv", "q_proj", "k_proj", "v_proj")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn_ctx: AttentionContext) -> torch.Tensor:
        tokens, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        q_width = self.q_proj.out_features
        v = qkv[:, q_width + kv_heads * dim:].view(tokens, kv_heads, dim)  # [T, Hkv, D]
        cos, sin = attn_ctx.rope_cos_sin(self.rotary, positions)
        if self.output_gate or self.qk_norm:
            if self.output_gate:  # q_proj rows are grouped per head as [q_h; gate_h] (Qwen3.5)
                q, gate = qkv[:, :q_width].view(tokens, heads, 2 * dim).chunk(2, dim=-1)  # [T, H, D]
            else:
                q = qkv[:, :q_width].view(tokens, heads, dim)  # [T, H, D]
            k = qkv[:, q_width:q_width + kv_heads * dim].view(tokens, kv_heads, dim)  # [T, Hkv, D]
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary.rotate_(q, cos, sin), self.rotary.rotate_(k, cos, sin)
        else:  # q and k heads are adjacent columns: one rotation for both
            qk = self.rotary.rotate_(qkv[:, :q_width + kv_heads * dim].view(tokens, heads + kv_heads, dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]  # [T, H, D], [T, Hkv, D]
        out = attn_ctx.attend(self.attn_layer_idx, q, k, v, self.scale, self.sliding_window).flatten(1)  # [T, H*D]
        if self.output_gate:
            out = out * torch.sigmoid(gate.flatten(1))
        return self.o_proj(out)


class GatedMLP(FusedProjections):
    """SwiGLU: ``down(silu(gate x) * up x)``; ``bias`` on all three projections (Llama ``mlp_bias``).

    fp32 gate and up stay two matmuls: fused into one [2I, Hd] weight they were slower on this machine (32 x 576 by
    576 x 3,072 took 4.6-5.3 ms against 3.8-4.4 ms for the two halves, process CPU time, one thread). With the
    packed oneDNN weights of ``cpu_linear`` the fused one took 0.92-1.02x the time of two at 1-32 rows and
    0.97-1.10x at 512 (SmolLM2's 30 MLPs, 2 threads, two interleaved runs): no gain that pays for the fusion.
    Both in GGUF blocks, they are read by one kernel call over their stacked rows (``gate_up_weight``): the
    kernel reads the same bytes, the step saves a call (SmolLM2 Q4_1, 30 MLPs at one row: 3.55 ms for both
    projections against 3.69 ms in two calls, one thread).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up_weight = self.gate_up_bias = None

    def refuse(self) -> None:
        """Stack gate and up when both took GGUF blocks; otherwise each computes alone."""
        children = (self.gate_proj, self.up_proj)
        if all(isinstance(child.weight, QuantizedWeight) for child in children):
            self.fuse("gate_up", "gate_proj", "up_proj")
            return
        self._fused.pop("gate_up", None)
        self.gate_up_weight = self.gate_up_bias = None
        for child in children:
            child.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)  # [T, 2I]: gate columns, then up
        width = self.gate_proj.out_features
        return self.down_proj(F.silu(gate_up[..., :width]) * gate_up[..., width:])


class StackedExperts(nn.Module):
    """E SwiGLU experts stacked as in transformers v5 and gpt-fast.

    ``gate_up_proj`` [E, 2I, Hd] holds gate rows then up rows; ``down_proj`` [E, Hd, I].
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, Hd]; expert_ids, weights [T, k] -> [T, Hd]."""
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten()  # [T*k]
        order = flat_ids.argsort(stable=True)  # (token, slot) pairs grouped by expert
        token_of = order // top_k
        weight_of = weights.flatten()[order]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start : start + count]
            gate, up = F.linear(x[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])  # [n, Hd]
            out.index_add_(0, rows, y * weight_of[start : start + count, None])
            start += count
        return out


class SparseMoE(nn.Module):
    """Softmax top-k router (fp32) over stacked experts; optional renormalisation of the top-k."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, expert_ids = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.route(x))


class SharedExpertMoE(SparseMoE):
    """Routed experts plus one always-on SwiGLU expert scaled by ``sigmoid(shared_expert_gate x)`` (Qwen3.5-MoE)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 shared_intermediate_size: int):
        super().__init__(hidden_size, num_experts, top_k, intermediate_size, renormalize)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x += mixer(norm1(x)); x += mlp(norm2(x))``."""

    is_linear = False  # its mixer is attention (``self_attn``), never linear attention

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_ctx: AttentionContext) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), attn_ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
