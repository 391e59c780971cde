"""Export to the public DFlash layout, and load it back.

config.json: a Qwen3 config plus `block_size`, `num_target_layers`, `dflash_config:
{target_layer_ids, mask_token_id, block_size[, causal]}`, `layer_types`, `sliding_window`,
`architectures: ["DFlashDraftModel"]` and `auto_map` -> dflash.py (shared/dflash.py, copied:
`AutoModel.from_pretrained(dir, trust_remote_code=True)` loads it). model.safetensors:
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, ..., `fc.weight`, `hidden_norm.weight`,
`norm.weight` (docs/DESIGN.md, "The drafter"), in bf16. Non-finite weights are never exported.

    python -m train.export RUN_DIR/checkpoints/step-00000100.pt OUT_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import shared.dflash as shared_dflash
from shared.target import EXPORT_TARGET_KEY
from train.checkpoint import assert_finite
from train.config import DrafterConfig
from train.model import DFlashDrafter

MODELING_FILE = Path(shared_dflash.__file__)  # imports only torch and transformers: shipped as is


def export(model: DFlashDrafter, out: str | Path, dtype: torch.dtype = torch.bfloat16,
           target_tensors: str | None = None) -> Path:
    """target_tensors: the fingerprint of the store target's embed_tokens/lm_head
    (shared.target.tensors_fingerprint), kept in the weights' metadata so that evaluation refuses
    a target the drafter was not trained for."""
    out = Path(out)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    assert_finite(state, f"export {out}")  # also after the cast: bf16 overflows to inf
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))
    shutil.copyfile(MODELING_FILE, tmp / "dflash.py")
    meta = {"format": "pt", **({EXPORT_TARGET_KEY: target_tensors} if target_tensors else {})}
    save_file(state, str(tmp / "model.safetensors"), metadata=meta)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def load_drafter(path: str | Path, backend: str = "sdpa", dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    path = Path(path)
    cfg = DrafterConfig.load(path / "config.json")
    model = DFlashDrafter(cfg, backend=backend)
    model.load_state_dict({k: v.to(dtype) for k, v in load_file(str(path / "model.safetensors")).items()})
    return model.to(dtype)


def main(argv=None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    ck = torch.load(argv[0], map_location="cpu", weights_only=False)
    model = DFlashDrafter(DrafterConfig(**ck["drafter"]))
    model.load_state_dict(ck["model"])
    print(export(model, argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
