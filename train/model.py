"""The DFlash drafter (architecture of the public DFlash checkpoints, DESIGN.md section 3).

A Qwen3-style decoder stack with no embedding or LM head of its own. The selected target
layers are concatenated and fused (`fc`, then `hidden_norm`); every layer attends from the
block's slots to [fused context | block] through the same k/v projections; queries come from
the block only. Parameter names match the public checkpoints, so export is a plain state_dict.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from train.attention import attend
from train.config import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(positions: torch.Tensor, dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (*positions.shape, dim), as Qwen3 computes them."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    f = positions.float()[..., None] * inv
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    """x: (B, heads, T, D); cos/sin: (B, T, D)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, sliding: bool):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.nh * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * D, H, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.sliding = sliding

    def forward(self, x, ctx, cos_q, sin_q, cos_kv, sin_kv, masks, backend):
        """x: (B, Q, H) block slots; ctx: (B, S, H) fused context."""
        B, Q, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(B, -1, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, -1, self.nkv, self.d).transpose(1, 2)
        q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos_kv, sin_kv)
        out = attend(q, k, v, masks["sliding" if self.sliding else "full"], backend)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, i: int):
        super().__init__()
        self.self_attn = Attention(cfg, sliding=cfg.layer_types[i] == "sliding_attention")
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, masks, backend):
        # The fused context is the same input to every layer (no residual update of it).
        x = x + self.self_attn(self.input_layernorm(x), ctx, *rope_q, *rope_kv, masks, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, backend: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.backend = backend  # "sdpa" | "flex" | "flex_compiled" (train.attention)
        n_ctx = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_ctx * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self):
        std = self.cfg.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, target_hidden, noise_emb, ctx_pos, block_pos, masks):
        """target_hidden: (B, S, n*H) selected target layers, concatenated; noise_emb: (B, Q, H)
        embedded block tokens; ctx_pos: (B, S); block_pos: (B, Q); masks from
        train.attention.build_masks. Returns the normed (B, Q, H) for the target's LM head."""
        cfg = self.cfg
        ctx = self.hidden_norm(self.fc(target_hidden))
        x = noise_emb
        rope_q = rope(block_pos, cfg.head_dim, cfg.rope_theta, x.dtype)
        rope_kv = rope(torch.cat([ctx_pos, block_pos], dim=1), cfg.head_dim, cfg.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, masks, self.backend)
        return self.norm(x)


def score_memory_bytes(cfg: DrafterConfig, batch: int, q_len: int, kv_len: int) -> int:
    """Memory of one layer's materialised fp32 score matrix (eager flex or dense attention),
    roughly doubled for the backward."""
    return 2 * 4 * batch * cfg.num_attention_heads * q_len * kv_len


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def unwrap(model: nn.Module) -> "DFlashDrafter":
    """The DFlashDrafter inside DDP and/or torch.compile wrappers."""
    inner = model.module if hasattr(model, "module") else model
    return getattr(inner, "_orig_mod", inner)
