"""What train/run.py builds a run from: the process group, the drafter config, the checks that
refuse a mismatched store before any work, the learning-rate schedule."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from shared.store import Store
from shared.target import load_tokenizer, tensors_fingerprint, tokenizer_fingerprint
from train.config import ConfigError, DrafterConfig, TrainConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device, bool]:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; otherwise one process (gloo on CPU, nccl on a
    GPU), so the same code path runs in the tests and on N GPUs. Returns (rank, world, device,
    whether this call created the process group, so the caller destroys it)."""
    under_torchrun = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cfg.gpus:
        device = torch.device("cuda", local if world > 1 else cfg.gpus[0])
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device, False
    kw = {"device_id": device} if backend == "nccl" else {}
    if under_torchrun:
        dist.init_process_group(backend, rank=rank, world_size=world, **kw)
    else:  # no environment variables set behind the caller's back
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1, **kw)
    return rank, world, device, True


def resolve_config(cfg: TrainConfig, store: Store) -> DrafterConfig:
    if cfg.draft:
        return DrafterConfig.load(cfg.draft)
    return DrafterConfig.default_for(store.manifest, cfg.draft_layers, cfg.block_size, cfg.mask_token_id)


def check_store(store: Store, dcfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor, target: str,
                allow_other_target: bool = False):
    """Refuse before any work when the store, the drafter config and the target tensors disagree."""
    man = store.manifest
    t = man.target
    problems = []
    missing = [l for l in dcfg.target_layer_ids if l not in store.layer_ids]
    if missing:
        problems.append(f"drafter target_layer_ids {dcfg.target_layer_ids} are not a subset of the store's "
                        f"layers {store.layer_ids} (missing {missing})")
    if dcfg.hidden_size != t.hidden_size:
        problems.append(f"drafter hidden_size {dcfg.hidden_size} != target's {t.hidden_size}")
    if dcfg.num_target_layers != t.num_hidden_layers:
        problems.append(f"drafter num_target_layers {dcfg.num_target_layers} != target's {t.num_hidden_layers}")
    if dcfg.vocab_size != t.vocab_size:
        problems.append(f"drafter vocab_size {dcfg.vocab_size} != target's {t.vocab_size}")
    shapes_ok = True
    for name, w in (("embed_tokens", embed), ("lm_head", head)):
        if tuple(w.shape) != (t.vocab_size, t.hidden_size):
            shapes_ok = False
            problems.append(f"{target}: {name} has shape {tuple(w.shape)}, the store's target has "
                            f"({t.vocab_size}, {t.hidden_size}): a store made by another target")
    if shapes_ok and not allow_other_target:
        fp = tensors_fingerprint(embed, head)
        if fp != t.tensors_fingerprint:
            problems.append(f"{target}: embed_tokens/lm_head fingerprint {fp} differs from the store's target "
                            f"({t.path}: {t.tensors_fingerprint}): the drafter would train against "
                            f"another model's embeddings and LM head (--allow-other-target if you mean it)")
    if not 0 <= dcfg.mask_token_id < t.vocab_size:
        problems.append(f"mask_token_id {dcfg.mask_token_id} outside the vocabulary")
    tok_dir = Path(target)
    if (tok_dir / "tokenizer.json").exists() or (tok_dir / "tokenizer_config.json").exists():
        fp = tokenizer_fingerprint(load_tokenizer(tok_dir))
        if fp != man.tokenizer.fingerprint:
            problems.append(f"{target}: tokenizer/chat template fingerprint {fp[:19]}... differs from the "
                            f"store's {man.tokenizer.fingerprint[:19]}...")
    if problems:
        raise ConfigError("refusing to train:\n  - " + "\n  - ".join(problems))


def lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step):
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        p = (step - warmup) / max(total - warmup, 1)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0)))
    return f
