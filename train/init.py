"""Draft layers started from the target's own last attention layers (`train --init-from-target`).

A randomly initialised drafter on a real target first learns token frequencies and sits at the
unigram loss for hundreds of steps before it learns to use the anchor and the context (BENCHMARKS.md,
"A real target"). A decoder layer of the target already maps the target's hidden states to
something its LM head reads; started from the target's last layers, the drafter leaves that plateau
sooner. Only the initial values change: the drafter, its export and what the engines load are the
same.

Layer i of an N-layer drafter takes target layer `attn[-N + i]`, where `attn` lists the target's
layers holding an attention block and an MLP (Qwen3.5's Gated DeltaNet layers are skipped). The
drafter's final norm takes the target's final norm, since both feed the same LM head. Per family
(shared/families.py): RMSNorm scales stored as offsets from 1 get the 1 added; a gated q_proj gives
the drafter its query rows only. A drafter tensor the target lacks (the q/k norms of a llama) keeps
its initial value; a shape that differs (a drafter config of its own) is refused with both shapes.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from shared.families import family_of
from shared.target import find_tensor, read_config, target_dir, tensor_index, text_decoder_tensor
from train.config import ConfigError

_LAYER_KEY = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)$")


def _decoder_layers(index: dict[str, Path]) -> dict[int, dict[str, str]]:
    """{layer: {name inside the layer: tensor name}} of the text decoder."""
    layers: dict[int, dict[str, str]] = {}
    for key in filter(text_decoder_tensor, index):
        if m := _LAYER_KEY.match(key):
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = key
    return layers


def init_from_target(drafter: nn.Module, target: str | Path) -> str:
    """Copy the target's last attention layers (and final norm) into the drafter in place; the
    line to log."""
    path = target_dir(target)
    fam = family_of(read_config(path)["model_type"])
    index = tensor_index(path)
    layers = _decoder_layers(index)
    final_norm = find_tensor(index, "model.norm.weight")  # also model.language_model.norm.weight
    attn = [i for i in sorted(layers) if "self_attn.q_proj.weight" in layers[i] and "mlp.down_proj.weight" in layers[i]]
    n = len(drafter.layers)
    if len(attn) < n:
        raise ConfigError(f"--init-from-target: {path} has {len(attn)} attention layer(s), the drafter {n} "
                          f"(train fewer --draft-layers, or leave the option out)")
    source = attn[-n:]
    handles: dict[Path, object] = {}

    def load(key: str) -> torch.Tensor:
        from safetensors import safe_open
        f = index[key]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f].get_tensor(key).float()

    def put(param: nn.Parameter, name: str, key: str):
        t = load(key)
        if fam.gated_query and re.fullmatch(r"self_attn\.q_proj\.(weight|bias)", name) and \
                t.shape[0] == 2 * param.shape[0]:
            d = drafter.layers[0].self_attn.d  # per head: d query rows, then d gate rows
            t = t.reshape(-1, 2, d, *t.shape[1:])[:, 0].reshape(-1, *t.shape[1:])
        if name.endswith("norm.weight"):
            t = t + fam.norm_offset
        if t.shape != param.shape:
            raise ConfigError(f"--init-from-target: {key} of {path} has shape {tuple(t.shape)}, the drafter's "
                              f"{name} {tuple(param.shape)} (a drafter config that differs from the target's "
                              f"layers cannot start from them)")
        with torch.no_grad():
            param.copy_(t)

    kept, unused = set(), set()
    for layer, i in zip(drafter.layers, source):
        names = dict(layer.named_parameters())
        for name, param in names.items():
            if name in layers[i]:
                put(param, name, layers[i][name])
            else:
                kept.add(name)
        unused |= {k for k in layers[i] if k not in names}
    if final_norm is not None:
        put(drafter.norm.weight, "norm.weight", final_norm)
    else:
        kept.add("norm.weight")
    line = f"draft layers started from target layers {source}"
    if kept:
        line += f"; at their initial values: {', '.join(sorted(kept))}"
    if unused:
        line += f"; target tensors not used: {', '.join(sorted(unused))}"
    return line
