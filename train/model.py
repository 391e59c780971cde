"""The trainer's DFlash drafter: the layers of shared/dflash.py (the file every export ships)
with the attention backend chosen for training (flex, compiled flex, or SDPA). Parameter names
match the public checkpoints, so export is a plain state_dict."""

from __future__ import annotations

import torch
import torch.nn as nn

from train.attention import attend
from train.config import DrafterConfig
from shared.dflash import DFlashStack


class DFlashDrafter(nn.Module, DFlashStack):
    def __init__(self, cfg: DrafterConfig, backend: str = "sdpa", kernel_options: dict | None = None):
        super().__init__()
        self.cfg = cfg
        self.backend = backend  # "sdpa" | "flex" | "flex_compiled" (train.attention)
        self.kernel_options = dict(kernel_options or {})  # flex's; they change speed, not the math
        self.build_stack(cfg, len(cfg.target_layer_ids))
        self.reset_parameters()

    def reset_parameters(self):
        std = self.cfg.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, target_hidden, noise_emb, ctx_pos, block_pos, masks):
        """See DFlashStack.run; masks from train.attention.build_masks."""
        return self.run(target_hidden, noise_emb, ctx_pos, block_pos, masks, self._attend)

    def _attend(self, q, k, v, mask):
        return attend(q, k, v, mask, self.backend, self.kernel_options)


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


def attention_backend(attention: str, compile: str, cuda: bool) -> str:
    """The attention path a run uses: flex on the GPU (its call compiled on its own under
    `--compile attention`), SDPA with the dense mask on the CPU (flex has no backward there)."""
    backend = {"auto": "flex" if cuda else "sdpa", "flex": "flex", "sdpa": "sdpa"}[attention]
    return "flex_compiled" if backend == "flex" and compile == "attention" else backend


def compile_drafter(drafter: DFlashDrafter, mode: str) -> nn.Module:
    """What the step calls. blocks: each decoder layer compiled on its own, in place (attention
    fused with its projections, norms and MLP; same-kind layers share one graph), and so are the
    context's and the output's RMSNorms (eager, each holds float32 copies of its (tokens, hidden)
    input for the backward: the memory `full` did not spend); fc, the rotary tables, the LM head
    and the loss stay eager, the last two chunked; full: the whole drafter; attention/none:
    nothing here (docs/DESIGN.md, "Selective compilation")."""
    if mode == "full":
        return torch.compile(drafter, dynamic=False)
    if mode == "blocks":
        for m in (*drafter.layers, drafter.hidden_norm, drafter.norm):
            m.compile(dynamic=False)
    return drafter


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process: constant after the first step when nothing
    recompiles (shapes are static: rows of seq_len, a fixed anchor count)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])
