"""`train --init-from-target`: draft layers started from the target's last attention layers. Each
copied module must compute what the target's module computes (norms stored as offsets from 1,
a gated q_proj's query rows), checked module by module against the loaded HF model."""

from __future__ import annotations

import json

import pytest
import torch

from shared.target import decoder_layers, load_target
from train.config import ConfigError, DrafterConfig
from train.init import init_from_target
from train.model import DFlashDrafter


def drafter_like(tiny_cfg: dict, layers: int, **kw) -> DFlashDrafter:
    torch.manual_seed(1)
    cfg = DrafterConfig(**{**tiny_cfg, "num_hidden_layers": layers, "layer_types": None, **kw})
    return DFlashDrafter(cfg)


QWEN35 = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
              vocab_size=512, num_target_layers=4, target_layer_ids=[0, 3], mask_token_id=1, block_size=4)


def same_modules(d_layer, t_layer, x: torch.Tensor, gated: bool, qk_norms: bool):
    """The drafter layer's projections, norms and MLP against the target layer's on one input."""
    da, ta = d_layer.self_attn, t_layer.self_attn
    for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
        torch.testing.assert_close(getattr(d_layer, name)(x), getattr(t_layer, name)(x))
    q = ta.q_proj(x)
    if gated:  # per head: the query half of (query, gate), as the target's attention splits it
        q = q.view(*x.shape[:-1], -1, 2 * da.d).chunk(2, dim=-1)[0].reshape(*x.shape[:-1], -1)
    torch.testing.assert_close(da.q_proj(x), q)
    for name in ("k_proj", "v_proj"):
        torch.testing.assert_close(getattr(da, name)(x), getattr(ta, name)(x))
    h = torch.randn(*x.shape[:-1], da.nh * da.d)
    torch.testing.assert_close(da.o_proj(h), ta.o_proj(h))
    heads = torch.randn(3, da.d)
    for name in ("q_norm", "k_norm"):
        want = getattr(ta, name)(heads) if qk_norms else torch.ones(da.d)
        got = getattr(da, name)(heads) if qk_norms else getattr(da, name).weight.detach()
        torch.testing.assert_close(got, want)


def test_qwen35_draft_layer_computes_what_the_targets_full_attention_layer_does(tiny):
    target = load_target(tiny["target"], torch.device("cpu"), torch.float32)
    drafter = drafter_like(QWEN35, 1)
    line = init_from_target(drafter, tiny["target"])
    assert "target layers [2]" in line  # the tiny target's one full-attention layer (the others are DeltaNet)
    x = torch.randn(2, 5, 64) * 3
    with torch.no_grad():
        same_modules(drafter.layers[0], decoder_layers(target)[2], x, gated=True, qk_norms=True)
        torch.testing.assert_close(drafter.norm(x), target.model.norm(x))
    # not copied: the drafter's own fc and hidden_norm keep their initial values
    fresh = drafter_like(QWEN35, 1)
    assert torch.equal(drafter.fc.weight, fresh.fc.weight)
    assert not torch.equal(drafter.layers[0].mlp.up_proj.weight, fresh.layers[0].mlp.up_proj.weight)


def test_more_draft_layers_than_target_attention_layers_is_refused(tiny):
    with pytest.raises(ConfigError, match="1 attention layer\\(s\\), the drafter 2"):
        init_from_target(drafter_like(QWEN35, 2), tiny["target"])


def test_a_drafter_of_other_shapes_is_refused_naming_both(tiny):
    with pytest.raises(ConfigError, match=r"shape \(128, 64\), the drafter's mlp.gate_proj.weight \(96, 64\)"):
        init_from_target(drafter_like(QWEN35, 1, intermediate_size=96), tiny["target"])


def test_llama_draft_layers_are_its_last_layers_with_unit_qk_norms(tiny, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = tiny["tokenizer"]
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from their initial ones, so that a copy shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "llama")
    drafter = drafter_like({**QWEN35, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                            "num_target_layers": 3, "target_layer_ids": [0, 2]}, 2)
    line = init_from_target(drafter, tmp_path / "llama")
    assert "target layers [1, 2]" in line and "self_attn.k_norm.weight, self_attn.q_norm.weight" in line
    x = torch.randn(2, 5, 64) * 3
    with torch.no_grad():
        for d, t in zip(drafter.layers, model.model.layers[1:]):
            same_modules(d, t, x, gated=False, qk_norms=False)
        torch.testing.assert_close(drafter.norm(x), model.model.norm(x))


def test_training_starts_from_the_target_and_a_resume_from_its_checkpoint(tiny, store, tmp_path, monkeypatch):
    """The option reaches the trainer's drafter; a resumed run takes its weights from the
    checkpoint (the target's layers are not copied over them)."""
    import train.loop as tl
    from conftest import tcfg

    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps(DrafterConfig(**{**QWEN35, "mask_token_id": tiny["tokenizer"].mask_token_id},
                                              num_hidden_layers=1).to_hf()))
    built, real_build = [], tl.build_run

    def build_run(*args):
        run = real_build(*args)
        built.append({k: v.detach().clone() for k, v in run.drafter.state_dict().items()})
        return run

    monkeypatch.setattr(tl, "build_run", build_run)
    tl.train(tcfg(store, draft, tmp_path / "run", max_steps=4, stop_after=2, save_every=2, init_from_target=True))
    target = load_target(tiny["target"], torch.device("cpu"), torch.float32)
    w = decoder_layers(target)[2].mlp.down_proj.weight
    assert torch.equal(built[0]["layers.0.mlp.down_proj.weight"], w)
    tl.train(tcfg(store, draft, tmp_path / "run", max_steps=4, save_every=2, init_from_target=True, resume=True))
    ck = torch.load(tmp_path / "run" / "checkpoints" / "step-00000002.pt", weights_only=False)
    assert torch.equal(built[1]["layers.0.mlp.down_proj.weight"], ck["model"]["layers.0.mlp.down_proj.weight"])
    assert not torch.equal(built[1]["layers.0.mlp.down_proj.weight"], w)
