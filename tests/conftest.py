"""Shared fixtures: a tiny hybrid target and a small chat corpus, built once per test session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict:
    """A 4-layer qwen3_5_text target (3 DeltaNet + 1 full attention), hidden 64, and 48 chat rows."""
    from shared.tiny import build_target, build_tokenizer, stdlib_chat_pairs

    root = tmp_path_factory.mktemp("tiny")
    rows = stdlib_chat_pairs(max_source_chars=600)[:48]
    texts = [m["content"] for r in rows for m in r["messages"]]
    tok = build_tokenizer(texts, root / "target", vocab_size=512)
    build_target(tok, root / "target", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                 linear_value_head_dim=16, initializer_range=0.2)
    corpus = root / "chat.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"target": root / "target", "corpus": corpus, "rows": rows, "tokenizer": tok}


def extract_cfg(tiny, store: Path, **kw):
    from extract.config import ExtractConfig
    base = dict(data=str(tiny["corpus"]), target=str(tiny["target"]), store=str(store), layer_ids=[0, 1, 3],
                max_len=256, shard_tokens=1024, chunk_tokens=64, batch_tokens=1024, topk=8, progress=False)
    base.update(kw)
    return ExtractConfig(**base)


def read_all(store: Path) -> dict:
    """Every array of a store as numpy, for exact comparisons."""
    import zarr
    g = zarr.open_group(str(store), mode="r")
    out = {}
    for group in ("tokens", "features", "logits", "index"):
        for name, arr in g[group].arrays():
            out[f"{group}/{name}"] = arr[:]
    return out


def mask_runs(tok, ids, mask) -> list[str]:
    """The loss-masked tokens of a sequence, decoded run by run."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(int(i))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]
