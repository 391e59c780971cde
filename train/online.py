"""Online features: the target forward inside the training step (the baseline this project
replaces). Used for the parity check (offline == online training) and the speed comparison.

The rows the loader packs are split back into their documents and each document runs through
the target on its own (packing by position ids is wrong for DeltaNet layers, docs/DESIGN.md,
"Measured toolchain facts"); the captured layers are rounded to bf16, exactly what the store holds.
"""

from __future__ import annotations

import torch

from shared.features import forward_features


class OnlineFeatures:
    def __init__(self, target_model, layer_ids: list[int]):
        self.model, self.layer_ids = target_model, layer_ids

    @torch.no_grad()
    def __call__(self, batch: dict) -> dict:
        ids, doc = batch["input_ids"], batch["doc"]
        B, S = ids.shape
        out = torch.zeros(B, S, len(self.layer_ids) * self.model.config.hidden_size,
                          dtype=torch.bfloat16, device=ids.device)
        for b in range(B):
            for d in doc[b].unique().tolist():
                if d < 0:
                    continue
                pos = torch.nonzero(doc[b] == d).flatten()
                x = ids[b, pos][None]
                h, *_ = forward_features(self.model, x, [x.shape[1]], self.layer_ids, topk=1)
                out[b, pos] = h.reshape(len(pos), -1).to(torch.bfloat16)
        batch = {k: v for k, v in batch.items() if k != "hidden_scale"}
        batch["hidden"] = out
        return batch
