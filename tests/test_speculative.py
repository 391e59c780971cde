"""Speculative decoding equals greedy decoding exactly; tau bookkeeping; offline estimate = real."""

from __future__ import annotations

import random

import pytest
import torch

from eval.speculative import (Target, accept_length, acceptance_summary, drafter_proposal, greedy, load_served_drafter,
                              speculative)
from train.config import DrafterConfig
from train.export import export
from train.loss import accepted_per_block, slot_targets
from train.model import DFlashDrafter


def exported(drafter: DFlashDrafter, path) -> torch.nn.Module:
    """The trainer's drafter as evaluation loads it: exported (bf16), then read back through the
    export's own modeling file. Weights are rounded to bf16 first so both hold the same values."""
    for p in drafter.parameters():
        p.data = p.data.bfloat16().float()
    return load_served_drafter(export(drafter, path))


@pytest.fixture(scope="module")
def target(tiny):
    from shared.target import load_target
    return load_target(tiny["target"], torch.device("cpu"), torch.float32)


def prompts(tiny, n=3):
    tok = tiny["tokenizer"]
    out = []
    for r in tiny["rows"][:n]:
        text = tok.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"][:40])
    return out


def test_accept_and_tau_bookkeeping_hand_worked():
    assert accept_length([5, 6, 7], [5, 6, 9]) == 2
    assert accept_length([5, 6, 7], [1, 6, 7]) == 0
    assert accept_length([5, 6, 7], [5, 6, 7]) == 3
    # blocks commit accepted + 1 tokens: 3, 1, 4, 1 -> tau 9/4
    s = acceptance_summary([3, 1, 4, 1], block_size=4)
    assert s["tau"] == 2.25 and s["histogram"] == [0, 2, 0, 1, 1] and s["blocks"] == 4


def test_partial_accepts_roll_back_deltanet_state(tiny, target):
    """An oracle drafter proposes the greedy continuation with planted mistakes, forcing accepts
    of every length. Any stale DeltaNet/conv state after a rollback changes the output."""
    block = 6
    plain = Target(target, [])
    spec_t = Target(target, [0, 3])
    for p in prompts(tiny):
        ref = greedy(plain, list(p), 40, eos=None)
        full = list(p) + ref.tokens
        rng = random.Random(len(p))

        def oracle(tokens, ctx):
            n = len(tokens)
            out = list(full[n:n + block - 1]) + [0] * (block - 1)
            out = out[:block - 1]
            j = rng.randrange(block)              # first wrong slot (block - 1: all right)
            if j < block - 1:
                out[j] = (out[j] + 1) % 512
            return out

        s = speculative(spec_t, oracle, list(p), 40, eos=None)
        assert s.tokens == ref.tokens
        assert s.recomputes > 0 and max(s.blocks) == block and min(s.blocks) == 1  # every kind of accept
        assert sum(s.blocks) >= 40 and s.forwards == len(s.blocks) + 1


def test_without_rollback_the_output_would_differ(tiny, target, monkeypatch):
    """The rollback matters: skipping the snapshot restore corrupts the hybrid state."""
    import eval.speculative as sp
    monkeypatch.setattr(sp.copy, "deepcopy", lambda c: c)  # "snapshot" is the live cache
    plain, spec_t = Target(target, []), Target(target, [0])
    p = prompts(tiny, 1)[0]
    ref = greedy(plain, list(p), 30, eos=None)
    wrong = lambda tokens, ctx: [1, 2, 3]  # noqa: E731  rejected drafts that get cached
    assert speculative(spec_t, wrong, list(p), 30, eos=None).tokens != ref.tokens


def test_real_drafter_output_equals_greedy(tiny, target, tmp_path):
    cfg = DrafterConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        intermediate_size=128, num_hidden_layers=2, vocab_size=512, num_target_layers=4,
                        target_layer_ids=[0, 3], mask_token_id=3, block_size=8,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    embed, head = target.get_input_embeddings().weight, target.lm_head.weight
    propose = drafter_proposal(exported(drafter, tmp_path / "export"), embed, head)
    for p in prompts(tiny):
        ref = greedy(Target(target, []), list(p), 32, eos=None)
        s = speculative(Target(target, [0, 3]), propose, list(p), 32, eos=None)
        assert s.tokens == ref.tokens


def test_offline_estimate_equals_real_acceptance(tiny, target, tmp_path):
    """With the target's own greedy continuation as the data, the training-time estimate at the
    anchors decoding used gives each block's real committed length."""
    from shared.features import forward_features
    torch.manual_seed(1)
    cfg = DrafterConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        intermediate_size=128, num_hidden_layers=2, vocab_size=512, num_target_layers=4,
                        target_layer_ids=[0, 1, 3], mask_token_id=3, block_size=4,
                        # a causal sliding layer whose window (3) is shorter than the block: the
                        # training mask and the serving mask must agree on it too
                        layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    drafter = DFlashDrafter(cfg).eval()
    # A few training steps on the target's own choices, so that blocks of several lengths occur.
    embed, head = target.get_input_embeddings().weight, target.lm_head.weight
    p = prompts(tiny, 1)[0]
    ref = greedy(Target(target, []), list(p), 48, eos=None)
    full = torch.tensor([list(p) + ref.tokens])
    S = full.shape[1]
    with torch.no_grad():
        hidden, idx, _, _, _ = forward_features(target, full, [S], [0, 1, 3], topk=1)
    batch = {"hidden": hidden.reshape(1, S, -1), "input_ids": full, "loss_mask": torch.ones(1, S, dtype=torch.bool),
             "doc": torch.zeros(1, S, dtype=torch.long), "argmax": idx[:, 0][None]}
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    from train.step import StepConfig, forward_loss
    for step in range(60):
        anchors = torch.randint(0, S - 1, (1, 16)).sort().values
        b = dict(batch, anchors=anchors, anchor_valid=torch.ones(1, 16, dtype=torch.bool))
        loss, _, tg = forward_loss(drafter, embed, head, b, StepConfig.of(drafter, labels="argmax"))
        (loss / tg["weight"].sum()).backward()
        opt.step()
        opt.zero_grad()
    drafter.eval()
    # decoding runs the export through its own modeling file (one block per step, the serving
    # mask); the estimate runs the trainer's drafter with the training mask at the same anchors
    served = exported(drafter, tmp_path / "export")
    real = speculative(Target(target, [0, 1, 3]), drafter_proposal(served, embed, head), list(p), 48, eos=None)
    assert real.tokens == ref.tokens
    anchors = torch.tensor([real.anchors])
    b = dict(batch, anchors=anchors, anchor_valid=torch.ones_like(anchors, dtype=torch.bool))
    with torch.no_grad():
        from train.step import draft
        out = draft(drafter, embed, b)
        pred = (out @ head.T).argmax(-1).reshape(1, len(real.anchors), cfg.block_size)
    tg = slot_targets(b, cfg.block_size, 7.0, "argmax")
    est = accepted_per_block(pred, tg)[0].tolist()
    # the last block may be cut by max_new / the end of the stored sequence
    assert est[:-1] == real.blocks[:-1]
    assert len(set(real.blocks)) > 1, real.blocks  # the comparison covers more than one length


def test_several_drafters_share_the_baselines_and_match_one_at_a_time(tiny, target, tmp_path):
    """decode_many: drafters reading different target layers, with different block sizes, decoded
    beside one another after one greedy decoding per prompt (and one prompt-lookup decoding per
    block size), get the figures each gets alone."""
    from eval.speculative import decode_all, decode_many
    drafters = {}
    for name, layers, seed, block in (("a", [0, 3], 0, 4), ("b", [1, 2, 3], 1, 6)):
        cfg = DrafterConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            intermediate_size=128, num_hidden_layers=1, vocab_size=512, num_target_layers=4,
                            target_layer_ids=layers, mask_token_id=3, block_size=block)
        torch.manual_seed(seed)
        drafters[name] = exported(DFlashDrafter(cfg).eval(), tmp_path / name)
    ps = prompts(tiny, 2)
    both = decode_many(target, drafters, ps, 24, None, progress=False)
    assert list(both) == ["a", "b"]
    drop = ("speculative_seconds", "speedup", "greedy_seconds", "greedy_ms_per_token")
    for name, d in drafters.items():
        alone = decode_all(target, d, ps, 24, None, progress=False)
        got = {k: v for k, v in both[name].items() if k not in drop}
        want = {k: v for k, v in alone.items() if k not in drop}
        for r in (got, want):  # prompt lookup's timings differ between runs too
            r["prompt_lookup"] = {k: v for k, v in r["prompt_lookup"].items() if k not in drop}
        assert got == want and not got["mismatches"]
