"""The static-cache greedy decoder against transformers' `generate`, one prompt at a time with no
padding (the plain reference): same tokens, same stop, for prompts of different lengths batched
together and for the dense families it serves."""

from __future__ import annotations

import pytest
import torch

from regenerate.decode import StaticGreedy, supports_static


def tiny_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(1)
    m = LlamaForCausalLM(LlamaConfig(**kw)) if kind == "llama" else Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw))
    return m.eval()


def reference(model, prompt, max_new, eot):
    dev = model.device
    out = model.generate(input_ids=torch.tensor([prompt], device=dev),
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=dev),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=eot, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    return (new[:new.index(eot)], True) if eot in new else (new, False)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # on a GPU: the step as a CUDA graph


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_static_greedy_equals_generate_alone_for_each_prompt(kind, device):
    model = tiny_model(kind).to(device)
    assert supports_static(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (5, 23, 1, 17)]
    max_new = 40
    # an end of turn that one prompt reaches early: the row stops there, the others run on
    free = reference(model, prompts[0], max_new, eot=-1)[0]
    eot = free[6]
    want = [reference(model, p, max_new, eot) for p in prompts]
    assert want[0] == (free[:free.index(eot)], True)
    dec = StaticGreedy(model, batch_size=6, bucket=32, check_every=4, prefill_chunk=8)  # prompts span chunks
    got = dec.run(prompts, max_new, eot, pad=0)
    assert got == want
    # the same decoder again, another batch (the cache is reset, the batch is partly filled)
    assert dec.run(prompts[2:], max_new, eot, pad=0) == want[2:]


def test_the_hybrid_family_is_not_decoded_statically(tiny):
    from shared.target import load_target
    m = load_target(tiny["target"], torch.device("cpu"), torch.float32)
    assert not supports_static(m)
