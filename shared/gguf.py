"""A .gguf target as a checkpoint folder: converted once, then used like any other target.

transformers reads a GGUF file (its weights dequantized to float, its tokenizer and chat template
from the file's metadata; the `gguf` package does the reading). Every stage then needs the same
thing a folder gives (config.json, safetensors for embed/lm_head and fingerprints, the
tokenizer), so the file is converted into a folder under the target cache, keyed by the file's
sha256: the weights as used, float32, which the manifest fingerprints like any checkpoint's. The
folder appears whole (written under a temporary name, then renamed), so a crash leaves no half
target and concurrent workers convert at most once each and use one result.

    DFLASH_TARGET_CACHE   where converted targets go (default ~/.cache/dflash-offline/targets)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

SOURCE = "gguf_source.json"  # in a converted folder: the file it came from and its sha256


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_TARGET_CACHE") or Path.home() / ".cache" / "dflash-offline" / "targets")


def target_dir(path: str | Path) -> Path:
    """The checkpoint folder of a target: `path` itself, or a .gguf file's converted folder."""
    p = Path(path)
    if p.suffix.lower() != ".gguf":
        return p
    from shared.target import TargetError
    if not p.is_file():
        raise TargetError(f"TARGET {p}: no such file")
    st = p.resolve().stat()
    return _converted(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _converted(path: str, size: int, mtime_ns: int) -> Path:
    p = Path(path)
    h = hashlib.sha256()
    with p.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    sha = h.hexdigest()
    out = cache_root() / f"{p.stem}-{sha[:16]}"
    if (out / SOURCE).exists():
        return out
    from shared.progress import log
    log(f"TARGET {p}: converting the GGUF file once into {out} (float32 weights, its tokenizer and chat template)")
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert(p, tmp)
        (tmp / SOURCE).write_text(json.dumps({"gguf": str(p), "bytes": size, "sha256": sha}, indent=2))
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first: use its folder
            if not (out / SOURCE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert(gguf_file: Path, out: Path):
    """The GGUF file's model (dequantized, float32) and tokenizer saved as a checkpoint folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.target import TargetError
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     dtype=torch.float32)
    except ImportError as e:
        raise TargetError(f"TARGET {gguf_file}: reading GGUF needs the `gguf` and `accelerate` packages "
                          f"(pip install -e '.[real]'): {e}") from None
    except (ValueError, OSError, KeyError) as e:
        if "pip install" in str(e):  # transformers says which package is missing this way too
            raise TargetError(f"TARGET {gguf_file}: reading GGUF needs the `gguf` and `accelerate` packages "
                              f"(pip install -e '.[real]'): {e}") from None
        raise TargetError(f"TARGET {gguf_file}: not a GGUF file transformers can read ({e})") from None
    # save_pretrained refuses a model loaded from GGUF (it counts as quantized): the dequantized
    # tensors and a config without the quantization entry are written as a plain checkpoint
    from safetensors.torch import save_file
    out.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same tensor as embed_tokens
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
