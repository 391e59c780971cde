"""The DFlash drafter's layers, and `DFlashDraftModel` for `AutoModel.from_pretrained(dir,
trust_remote_code=True)`.

This file imports only torch and transformers: the exporter copies it verbatim into every
export as `dflash.py` (config.json's auto_map points at it), and the trainer builds its drafter
from the same classes (train/model.py), so the AutoModel route computes what was trained.

Architecture (the public DFlash checkpoints): a Qwen3-style decoder stack with no embedding or
LM head of its own. The selected target layers are concatenated and fused (`fc`, then
`hidden_norm`); every layer attends from the block's slots to [fused context | block] through
the same k/v projections; queries come from the block only. Per layer, attention is causal
inside the block on sliding-window layers and bidirectional on full-attention layers, unless
`dflash_config.causal` sets every layer (vLLM's rule, followed by SGLang and SpecForge).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


# --- configuration, read the way the serving engines read it -----------------------------------

def _dflash(cfg) -> dict:
    d = getattr(cfg, "dflash_config", None)
    return d if isinstance(d, dict) else {}


def causal_setting(is_causal, dflash: dict):
    """The explicit causal setting of a config, in vLLM's order of precedence: top-level
    is_causal, then dflash_config.is_causal, then dflash_config.causal; None when none is set."""
    for src in (is_causal, dflash.get("is_causal"), dflash.get("causal")):
        if src is not None:
            return src
    return None


def layer_mask(cfg, i: int) -> tuple[bool, int | None]:
    """(causal, sliding window or None) of decoder layer i. An explicit causal setting (ours:
    cfg.causal; a config.json's, see causal_setting) applies to every layer; otherwise a layer is
    causal exactly when it slides."""
    sliding = (getattr(cfg, "layer_types", None) or [])[i:i + 1] == ["sliding_attention"]
    causal = getattr(cfg, "causal", None)
    if causal is None:
        causal = causal_setting(getattr(cfg, "is_causal", None), _dflash(cfg))
    return (sliding if causal is None else bool(causal)), (cfg.sliding_window if sliding else None)


ROPE_KEYS = ("rope_theta", "rope_parameters", "rope_scaling")


def parse_rope_theta(d: dict, where: str = "config") -> float | None:
    """rope_theta from a config's rope_theta / rope_parameters / rope_scaling (d holds those
    keys). Only plain RoPE is implemented: any scaling (yarn, linear, dynamic, ...) is refused
    with a ValueError, never dropped: a drafter run without it would not match serving."""
    theta = d.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        p = d.get(key)
        if p is None:
            continue
        if not isinstance(p, dict):
            raise ValueError(f"{where}: {key} must be an object, not {p!r}")
        kind = p.get("rope_type", p.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{where}: {key}.rope_type {kind!r} is not implemented (only plain RoPE, "
                             f"'default'); training with it ignored would not match serving")
        extra = set(p) - {"rope_type", "type", "rope_theta"}
        if extra:
            raise ValueError(f"{where}: {key} fields {sorted(extra)} are not implemented")
        if "rope_theta" in p:
            if theta is not None and float(p["rope_theta"]) != float(theta):
                raise ValueError(f"{where}: rope_theta {theta} and {key}.rope_theta {p['rope_theta']} differ")
            theta = p["rope_theta"]
    return None if theta is None else float(theta)


def rope_theta(cfg) -> float:
    theta = parse_rope_theta({k: getattr(cfg, k, None) for k in ROPE_KEYS}, type(cfg).__name__)
    return 1e6 if theta is None else theta


# --- layers -------------------------------------------------------------------------------------

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


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg, mask_kind: tuple[bool, int | None]):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        bias = getattr(cfg, "attention_bias", False)
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.nh * D, bias=bias)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=bias)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=bias)
        self.o_proj = nn.Linear(self.nh * D, H, bias=bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.mask_kind = mask_kind  # (causal, window): which of the masks this layer uses

    def forward(self, x, ctx, cos_q, sin_q, cos_kv, sin_kv, masks, attend):
        """x: (B, Q, H) block slots; ctx: (B, S, H) fused context."""
        B, Q, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(B, -1, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, -1, self.nkv, self.d).transpose(1, 2)
        q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos_kv, sin_kv)
        out = attend(q, k, v, masks[self.mask_kind])
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, i: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_mask(cfg, i))
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, masks, attend):
        # The fused context is the same input to every layer (no residual update of it).
        x = x + self.self_attn(self.input_layernorm(x), ctx, *rope_q, *rope_kv, masks, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashStack:
    """fc + hidden_norm + layers + norm, with the public parameter names, as attributes of the
    nn.Module that mixes this in (the trainer's DFlashDrafter, or DFlashDraftModel below)."""

    def build_stack(self, cfg, n_target_layers: int):
        self.fc = nn.Linear(n_target_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head_dim, self.theta = cfg.head_dim, rope_theta(cfg)

    def run(self, target_hidden, noise_emb, ctx_pos, block_pos, masks, attend=sdpa):
        """target_hidden: (B, S, n*H) selected target layers, concatenated; noise_emb: (B, Q, H)
        embedded block tokens; ctx_pos: (B, S); block_pos: (B, Q); masks: {(causal, window):
        mask for `attend`}. Returns the normed (B, Q, H) for the target's LM head."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        x = noise_emb
        rope_q = rope(block_pos, self.head_dim, self.theta, x.dtype)
        rope_kv = rope(torch.cat([ctx_pos, block_pos], dim=1), self.head_dim, self.theta, x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, masks, attend)
        return self.norm(x)


def single_block_masks(cfg, ctx_pos: torch.Tensor, block_pos: torch.Tensor) -> dict:
    """Dense masks for one block per row (decoding): block slot k, at position block_pos[k],
    anchored at a = block_pos[0], sees context positions < a and its block's slots (<= k when
    causal); with a window W, only positions >= block_pos[k] - (W - 1)."""
    a = block_pos[:, :1, None]                                           # (B, 1, 1)
    q = block_pos[:, :, None]                                            # (B, Q, 1)
    kv = torch.cat([ctx_pos, block_pos], dim=1)[:, None, :]              # (B, 1, S+Q)
    S, Q = ctx_pos.shape[1], block_pos.shape[1]
    in_ctx = (torch.arange(S + Q, device=kv.device) < S)[None, None]
    slot = (torch.arange(S + Q, device=kv.device) - S)[None, None]
    k = torch.arange(Q, device=kv.device)[None, :, None]
    out = {}
    for i in range(cfg.num_hidden_layers):
        causal, window = kind = layer_mask(cfg, i)
        m = torch.where(in_ctx, kv < a, (slot <= k) if causal else torch.ones_like(in_ctx))
        if window is not None:
            m = m & (kv >= q - (window - 1))
        out[kind] = m[:, None]
    return out


try:  # the AutoModel entry point; the trainer itself needs only the classes above
    from transformers import PreTrainedModel, Qwen3Config

    class DFlashDraftModel(PreTrainedModel, DFlashStack):
        """`AutoModel.from_pretrained(export, trust_remote_code=True)`. forward(target_hidden,
        noise_embedding, position_ids=None): target_hidden (B, S, n*H) holds the selected target
        layers (config.dflash_config.target_layer_ids: decoder-layer outputs, HF
        hidden_states[i + 1]) of the context positions; noise_embedding (B, block, H) is the
        target's embed_tokens of [last committed token, mask, mask, ...]; position_ids (B, S +
        block) default to 0..S+block-1. Returns the normed block states: logits are the target's
        lm_head of them."""

        config_class = Qwen3Config
        base_model_prefix = "dflash"
        _no_split_modules = ["DecoderLayer"]

        def __init__(self, config):
            super().__init__(config)
            n = len(_dflash(config).get("target_layer_ids") or [])
            self.block_size = _dflash(config).get("block_size", getattr(config, "block_size", 16))
            self.build_stack(config, n)  # top-level names: fc.weight, layers.0...., norm.weight
            self.post_init()

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))

        def forward(self, target_hidden, noise_embedding, position_ids=None, **_):
            B, S, _ = target_hidden.shape
            Q = noise_embedding.shape[1]
            if position_ids is None:
                position_ids = torch.arange(S + Q, device=target_hidden.device).expand(B, S + Q)
            ctx_pos, block_pos = position_ids[:, :S], position_ids[:, S:]
            masks = single_block_masks(self.config, ctx_pos, block_pos)
            return self.run(target_hidden, noise_embedding, ctx_pos, block_pos, masks, sdpa)
except ImportError:  # pragma: no cover - transformers is a dependency of this project
    pass
