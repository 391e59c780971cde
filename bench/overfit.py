"""Can the drafter learn one sample? The learning-curve check behind the real-target table: a
drafter trained on the first sample of a store (the same anchors each run), its loss and slot
accuracies every 25 steps; `--features zero` trains on zeroed target features instead, so a
curve that does not differ says the features are not used yet.

    python bench/overfit.py STORE [--draft-layers 1] [--steps 500] [--lr 3e-3] [--features real|zero] [--init-from-target]

Single process, fp32, SDPA with the dense mask (CPU or GPU); the store's target supplies the
embedding and LM head (its path must exist here).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from shared.store import Store
from shared.target import load_embed_and_head
from train.config import DrafterConfig
from train.init import init_from_target
from train.mask import sample_anchors
from train.model import DFlashDrafter
from train.step import StepConfig, forward_loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--mask-token-id", type=int, default=0)
    ap.add_argument("--features", choices=("real", "zero"), default="real")
    ap.add_argument("--init-from-target", action="store_true",
                    help="start the draft layers from the target's last ones, as `train --init-from-target`")
    a = ap.parse_args()
    torch.manual_seed(0)
    s = Store(a.store)
    man = s.manifest
    # the drafter reads every layer the store holds
    dc = replace(DrafterConfig.default_for(man, a.draft_layers, mask_token_id=a.mask_token_id),
                 target_layer_ids=list(s.layer_ids), layer_types=None)
    embed, head = (t.float() for t in load_embed_and_head(man.target.path))
    x = s.read(0)
    n = min(len(x.input_ids), a.tokens)
    hidden = x.hidden[:n].reshape(1, n, -1).float()
    batch = {"hidden": hidden if a.features == "real" else torch.zeros_like(hidden),
             "input_ids": x.input_ids[None, :n], "loss_mask": x.loss_mask[None, :n],
             "doc": torch.zeros(1, n, dtype=torch.long), "argmax": x.topk_idx[None, :n, 0]}
    print(f"{a.store} sample 0: {n} tokens, {int(x.loss_mask[:n].sum())} with loss; {a.draft_layers} draft "
          f"layer(s) on target layers {dc.target_layer_ids}, {a.features} features, lr {a.lr}"
          f"{', layers from the target' if a.init_from_target else ''}")
    model = DFlashDrafter(dc)
    if a.init_from_target:  # what `train --init-from-target` does
        print(init_from_target(model, man.target.path))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    sc = StepConfig.of(model, labels="argmax")
    g = torch.Generator().manual_seed(0)
    losses, t0 = [], time.perf_counter()
    for step in range(1, a.steps + 1):
        anchors, valid = sample_anchors(batch["loss_mask"][0], batch["doc"][0], a.anchors, g)
        loss, stats, tg = forward_loss(model, embed, head, dict(batch, anchors=anchors[None], anchor_valid=valid[None]), sc)
        loss = loss / tg["weight"].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step % 25 == 0:
            acc = (stats[1, 1:5] / stats[0, 1:5].clamp(min=1)).tolist()
            print(f"step {step:4d} ({time.perf_counter() - t0:4.0f}s)  loss {sum(losses[-25:]) / 25:.3f}  "
                  f"accuracy of slots 1-4 {[round(v, 2) for v in acc]}", flush=True)


if __name__ == "__main__":
    main()
