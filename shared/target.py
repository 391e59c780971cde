"""Target checkpoints: validation, loading, the layer-id convention, fingerprints, and loading
only `embed_tokens` / `lm_head` for the trainer. A target is a HF checkpoint folder of a supported
family (shared/families.py) or a .gguf file (converted once, shared/gguf.py).

Layer-id convention (docs/DESIGN.md, "Layer ids"): layer id i is the output of decoder layer i, i.e.
HF `hidden_states[i + 1]`. vLLM numbers the same layers one higher.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import struct
import sys
from pathlib import Path

import torch

from shared.families import FAMILIES, family_of, supported_model_types
from shared.gguf import target_dir

LAYER_CONVENTION = "layer id i = output of decoder layer i = HF hidden_states[i+1]"


class TargetError(RuntimeError):
    pass


def default_layer_ids(num_target_layers: int, num_draft_layers: int = 5) -> list[int]:
    """DFlash's default: layer 1 to layer L-3 evenly spaced; [L//2] for a single layer."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    ids = [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]
    # Tiny targets can collapse ids together: keep them distinct and in range.
    return sorted(set(min(max(i, 0), L - 1) for i in ids))


def read_config(path: str | Path) -> dict:
    """The target's decoder config as a dict, after checking that it is a checkpoint of a
    supported family (shared/families.py). A .gguf file is first converted (shared/gguf.py)."""
    path = target_dir(path)
    cfg_file = path / "config.json"
    if not path.exists():
        raise TargetError(f"TARGET {path}: no such directory")
    if not cfg_file.exists():
        raise TargetError(f"TARGET {path}: not a Hugging Face checkpoint directory (no config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise TargetError(f"TARGET {cfg_file}: invalid JSON ({e})") from None
    mt = cfg.get("model_type")
    fam = family_of(mt)
    if fam is None:
        raise TargetError(f"TARGET {cfg_file}: model_type {mt!r} is not supported "
                          f"(supported: {', '.join(supported_model_types())})")
    text = fam.text_config(cfg)
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if key not in text:
            raise TargetError(f"TARGET {cfg_file}: field {key!r} missing")
    if not list(path.glob("*.safetensors")):
        raise TargetError(f"TARGET {path}: no *.safetensors weights")
    return {**text, "model_type": mt, "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                      text.get("tie_word_embeddings", False))}


_QWEN35_MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"
_bound_to_torch = False


def use_torch_kernels_on_cpu():
    """Keep transformers off fla on CPU. With fla and triton installed, transformers binds fla's
    Triton kernels when the Qwen3.5 modeling module is imported, whatever the device, and every
    CPU forward fails ("0 active drivers"). So that module is imported with fla hidden, and fla
    is put back right after: nothing else in the process loses it."""
    global _bound_to_torch
    if _bound_to_torch:
        return
    if _QWEN35_MODELING in sys.modules:
        if importlib.util.find_spec("fla") is not None:
            raise TargetError("transformers' Qwen3.5 modeling was already imported with fla kernels in "
                              "this process; a CPU forward would fail. Load the target on CPU first.")
        _bound_to_torch = True
        return
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None  # `import fla` raises ImportError -> transformers binds the torch path
    try:
        importlib.import_module(_QWEN35_MODELING)
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)
    _bound_to_torch = True


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" = bf16 on a GPU, fp32 on the CPU (bf16 is slower than fp32 there); or "bf16"/"fp32"."""
    return {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
            "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def end_of_turn(tokenizer) -> tuple[str, int | None]:
    """The token that closes an assistant turn: ChatML's <|im_end|> when the vocabulary has it,
    else the tokenizer's eos. (text, id)."""
    if "<|im_end|>" in tokenizer.get_vocab():
        return "<|im_end|>", tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer.eos_token or "", tokenizer.eos_token_id


# Files a tokenizer loads from: the fast tokenizer's own file, or what a slow one is built from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt")


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer
    folder = target_dir(path)
    if folder.is_dir() and not any((folder / f).exists() for f in TOKENIZER_FILES):
        # transformers would blame a missing sentencepiece/tiktoken for a missing file
        raise TargetError(f"{folder} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there "
                          f"(copy the model's tokenizer.json beside its config.json)")
    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise TargetError(f"{folder}: the tokenizer could not be loaded: {str(e).strip().splitlines()[-1]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_target(path: str | Path, device: torch.device, dtype: torch.dtype):
    path = target_dir(path)
    cfg = read_config(path)
    if device.type == "cpu" and family_of(cfg["model_type"]).fla:
        use_torch_kernels_on_cpu()
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def decoder_layers(model) -> torch.nn.ModuleList:
    return (family_of(getattr(model.config, "model_type", None)) or FAMILIES[-1]).decoder_layers(model)


# --- fingerprints ---------------------------------------------------------------------------

def _safetensors_header(f: Path) -> bytes:
    with f.open("rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        return fh.read(n)


def check_safetensors(path: str | Path):
    """Open every safetensors file's header before any work: a truncated download or a garbled
    header is refused with the file's name, not found by a traceback after the store is planned."""
    for f in sorted(target_dir(path).glob("*.safetensors")):
        size = f.stat().st_size
        try:
            if size < 8:
                raise ValueError(f"{size} bytes, shorter than a safetensors header")
            with f.open("rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
            if n > size - 8:
                raise ValueError(f"header claims {n:,} bytes, the file has {size - 8:,} after its length")
            header = json.loads(_safetensors_header(f))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
            raise TargetError(f"TARGET {f}: not a readable safetensors file ({e})") from None
        if 8 + n + end > size:
            raise TargetError(f"TARGET {f}: truncated: its header needs {8 + n + end:,} bytes, the file has "
                              f"{size:,} (an interrupted download or copy?)")


def weights_fingerprint(path: str | Path) -> str:
    """sha256 over each safetensors file's header (names, dtypes, shapes, offsets), its size, and
    its first and last MiB of tensor bytes: cheap on 50 GB of weights, and changes when weights do
    in practice (same-shape retrains change the sampled bytes)."""
    h = hashlib.sha256()
    for f in sorted(target_dir(path).glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(_safetensors_header(f))
        size = f.stat().st_size
        h.update(str(size).encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return "sha256:" + h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer")
             else json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update((tokenizer.chat_template or "").encode() if isinstance(tokenizer.chat_template, (str, type(None)))
             else json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    return "sha256:" + h.hexdigest()


# --- embed / lm_head only -------------------------------------------------------------------

def tensor_index(path: Path) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it} of a checkpoint folder."""
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        return {k: path / v for k, v in json.loads(idx.read_text())["weight_map"].items()}
    out = {}
    for f in path.glob("*.safetensors"):
        for k in json.loads(_safetensors_header(f)):
            if k != "__metadata__":
                out[k] = f
    return out


def text_decoder_tensor(name: str) -> bool:
    """A tensor of the text model, not of a vision tower or a multi-token-prediction head."""
    return "visual" not in name and "mtp" not in name


def find_tensor(index: dict[str, Path], suffix: str) -> str | None:
    """The shortest text-model tensor name ending in suffix (the top-level one, e.g.
    model.norm.weight and not model.layers.3.linear_attn.norm.weight)."""
    hits = [k for k in index if k.endswith(suffix) and text_decoder_tensor(k)]
    return min(hits, key=len) if hits else None


def tensors_fingerprint(embed: torch.Tensor, head: torch.Tensor) -> str:
    """sha256 over every byte of the tensors training uses from the target (embed_tokens and
    lm_head, as stored): small next to the features, and the one thing a drafter must share
    with the store's target. Same-shape checkpoints (a retrain, a fine-tune) differ here."""
    h = hashlib.sha256()
    for t in (embed, head):
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().data)
    return "sha256:" + h.hexdigest()


EXPORT_TARGET_KEY = "dflash.target_tensors"  # a drafter export's safetensors metadata: tensors_fingerprint


def exported_target(drafter: str | Path) -> str | None:
    """The target fingerprint a drafter export records (None: an export from before, or from
    elsewhere): evaluation refuses another target with it."""
    from safetensors import safe_open
    with safe_open(str(Path(drafter) / "model.safetensors"), "pt") as f:
        return (f.metadata() or {}).get(EXPORT_TARGET_KEY)


def load_embed_and_head(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens.weight, lm_head.weight) read straight from the safetensors files: the rest
    of the target is never loaded."""
    from safetensors import safe_open
    path = target_dir(path)
    cfg = read_config(path)
    index = tensor_index(path)
    emb_key, head_key = find_tensor(index, "embed_tokens.weight"), find_tensor(index, "lm_head.weight")
    if emb_key is None:
        raise TargetError(f"TARGET {path}: no embed_tokens.weight tensor in its safetensors")
    if head_key is None and not cfg["tie_word_embeddings"]:
        raise TargetError(f"TARGET {path}: no lm_head.weight tensor and embeddings are not tied")

    def load(key):
        with safe_open(str(index[key]), framework="pt") as f:
            return f.get_tensor(key)

    emb = load(emb_key)
    return emb, (load(head_key) if head_key else emb)
