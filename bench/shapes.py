"""Model shapes the benchmarks use: the Qwen3.6-27B target and its published DFlash drafter."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB_27B = 248_320


def target_27b_config(num_layers: int = 64):
    """Qwen3.6-27B text shapes: hidden 5120, 64 layers (48 Gated DeltaNet + 16 gated full
    attention, 3:1), 24 heads x 256 (4 KV), DeltaNet 16 key / 48 value heads x 128, vocab 248,320."""
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(
        vocab_size=VOCAB_27B, hidden_size=5120, intermediate_size=17408, num_hidden_layers=num_layers,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=32768,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (num_layers // 4),
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                    "partial_rotary_factor": 0.25})


def drafter_27b_config(vocab: int = VOCAB_27B, layers: int = 5):
    from train.config import DrafterConfig
    return DrafterConfig(hidden_size=5120, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=17408, num_hidden_layers=layers, vocab_size=vocab,
                         num_target_layers=64, target_layer_ids=[1, 16, 31, 46, 61], mask_token_id=248070,
                         block_size=16, rope_theta=1e7,
                         layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
                         sliding_window=2048)


def random_target(cfg, device, dtype):
    """A target with random weights built directly on the device (no checkpoint on disk)."""
    import torch
    from shared.target import use_torch_kernels_on_cpu
    if torch.device(device).type == "cpu":
        use_torch_kernels_on_cpu()
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


def synthetic_manifest(cfg, hidden: int, num_layers: int, vocab: int, layer_ids: list[int], rows: int = 0):
    """The manifest of a benchmark store whose features come from an in-memory model."""
    from shared import schema as sc
    return sc.Manifest(
        target=sc.TargetInfo(path="in-memory", model_type="qwen3_5_text", num_hidden_layers=num_layers,
                             hidden_size=hidden, vocab_size=vocab, layer_types=None, weights_fingerprint="",
                             tensors_fingerprint="", config={}),
        tokenizer=sc.TokenizerInfo(fingerprint="", size=vocab, pad_token_id=0, eos_token_id=None, mask_token_id=None),
        data=sc.DataInfo(spec="synthetic", files=[], report={"rows": rows, "kept": rows, "truncated": 0,
                                                               "skipped": {}, "examples": {}}),
        layer_ids=list(layer_ids), layer_convention="", precision=cfg.precision, codec=cfg.codec, topk=cfg.topk,
        max_len=cfg.max_len, too_long=cfg.too_long, chat_template_kwargs={}, run_key={})
