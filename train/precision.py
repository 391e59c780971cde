"""bf16 parameters trained through float32 master copies (`--weights bf16`, the GPU default).

The step runs on bf16 weights, so autocast keeps no bf16 copy of each float32 weight for the
backward, and the gradients the backward writes are bf16; the optimizer (AdamW, its state in
float32) steps float32 masters, which are copied back into the model after every update. The
forward and backward compute exactly what autocast over float32 weights computes: autocast's
copy of a weight is the same rounding the bf16 parameter holds (docs/DESIGN.md, "The training
step")."""

from __future__ import annotations

import torch
import torch.nn as nn


class MasterWeights:
    """Float32 masters of a module's parameters: what the optimizer holds, what checkpoints save."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        module.to(torch.bfloat16)

    def take_grads(self):
        """Adds the model's (bf16) gradients into the masters' float32 gradients and frees them:
        called after every micro-batch's backward, so accumulation happens in float32."""
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    @torch.no_grad()
    def push(self):
        """The updated masters into the model's bf16 parameters."""
        torch._foreach_copy_(self.params, self.masters)

    def state_dict(self) -> dict:
        """The module's state_dict with the float32 masters in place of the bf16 parameters."""
        state = self.module.state_dict()
        state.update({n: m.detach().clone() for n, m in zip(self.names, self.masters)})
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        for n, m in zip(self.names, self.masters):
            m.copy_(state[n])
        self.module.load_state_dict({k: v.to(torch.bfloat16) if k in self.names else v for k, v in state.items()})
