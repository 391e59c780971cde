"""The built-in default: a tiny Qwen3.5-style hybrid target, its tokenizer and a chat corpus.

Nothing is downloaded. The corpus is made from the Python standard library's own source
(every machine with Python has it): each function with a docstring becomes a chat pair
"write a function that <docstring>" -> its source. The tokenizer is a byte-level BPE trained
on that corpus; the target is an 8-layer `qwen3_5_text` model (6 Gated DeltaNet layers and 2
full-attention layers) trained briefly on the corpus (a random target is not worth drafting
for), saved as an ordinary HF checkpoint directory with `tiny_training.json` (held-out loss).

    python -m shared.tiny --out build
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

# ChatML, as the Qwen family renders it: roles and content, tool definitions in the system turn,
# tool calls as <tool_call> JSON after the assistant's text, tool results as user turns with
# <tool_response>, and `enable_thinking=False` as an empty think block opening each assistant
# turn (the generation prompt included), as Qwen3 templates do. A plain chat renders exactly as
# '<|im_start|>ROLE\nCONTENT<|im_end|>\n' per message.
CHAT_TEMPLATE = (
    "{%- set nothink = enable_thinking is defined and not enable_thinking %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n<tools>' }}{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}{%- if nothink %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{{- message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call['function'] %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if nothink %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

# Fixed list so that the corpus is the same on every machine with the same Python.
STDLIB_MODULES = [
    "argparse", "ast", "base64", "bisect", "calendar", "collections/__init__", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib", "dis",
    "email/utils", "enum", "fnmatch", "fractions", "ftplib", "functools", "genericpath",
    "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html/__init__", "imaplib", "inspect",
    "ipaddress", "json/decoder", "json/encoder", "locale", "logging/__init__", "mailbox",
    "mimetypes", "ntpath", "numbers", "operator", "optparse", "os", "pathlib", "pickle",
    "pickletools", "platform", "plistlib", "poplib", "posixpath", "pprint", "quopri",
    "random", "re/_parser", "reprlib", "shlex", "shutil", "smtplib", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback",
    "typing", "urllib/parse", "urllib/request", "uuid", "warnings", "wave", "weakref",
    "zipfile/__init__", "zipimport",
]


def stdlib_chat_pairs(max_source_chars: int = 1500) -> list[dict]:
    """Chat rows {"messages": [...]} from stdlib functions that have a docstring."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for name in STDLIB_MODULES:
        path = root / f"{name}.py"
        if not path.exists():
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.name.startswith("__"):
                continue
            body = ast.get_source_segment(source, node)
            if not body or len(body) > max_source_chars:
                continue
            summary = doc.strip().split("\n\n")[0].replace("\n", " ")
            rows.append({"messages": [
                {"role": "user", "content": f"Write the Python function `{node.name}` "
                                            f"(module {name.replace('/', '.')}): {summary}"},
                {"role": "assistant", "content": body},
            ]})
    return rows


def build_tokenizer(texts: list[str], out: Path, vocab_size: int = 2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", mask_token="<|mask|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def tiny_config(vocab_size: int, **overrides):
    from transformers import Qwen3_5TextConfig

    kw = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=8192,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def build_target(tokenizer, out: Path, seed: int = 0, **overrides) -> Path:
    import torch

    from shared.target import use_torch_kernels_on_cpu
    use_torch_kernels_on_cpu()  # before transformers' Qwen3.5 modeling is first imported
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, **overrides)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def train_target(path: Path, rows: list[dict], steps: int = 250, seq_len: int = 256, batch: int = 8,
                 lr: float = 3e-3, seed: int = 0, held_out: int = 64) -> dict:
    """Train the tiny target in place on the chat rows (right-padded batches: packing would leak
    DeltaNet state across documents). Returns the report written to tiny_training.json."""
    import math
    import time

    import torch
    from shared.progress import progress_bar

    from shared.target import load_target, load_tokenizer
    from shared.data import Encoder, RowError

    tok = load_tokenizer(path)
    enc = Encoder(tok, seq_len, "truncate")
    seqs = []
    for i, r in enumerate(rows):
        try:
            seqs += [torch.from_numpy(ids.astype("int64")) for ids, _, _ in enc.encode(r, f"row {i}")[0]]
        except RowError:
            continue
    test, train = seqs[:held_out], seqs[held_out:]
    torch.manual_seed(seed)
    model = load_target(path, torch.device("cpu"), torch.float32).train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    g = torch.Generator().manual_seed(seed)

    def batch_of(items):
        from shared.features import pad_batch
        ids, att = pad_batch(items, tok.pad_token_id)
        labels = ids.masked_fill(att == 0, -100)
        return ids, att, labels

    def held_out_loss():
        model.eval()
        tot, n = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(test), batch):
                ids, att, labels = batch_of(test[i:i + batch])
                out = model(input_ids=ids, attention_mask=att, labels=labels)
                k = int((labels[:, 1:] != -100).sum())
                tot, n = tot + float(out.loss) * k, n + k
        model.train()
        return tot / max(n, 1)

    before = held_out_loss()
    t0 = time.time()
    for step in progress_bar(range(steps), desc="train tiny target", unit=" steps"):
        pick = torch.randint(0, len(train), (batch,), generator=g).tolist()
        ids, att, labels = batch_of([train[i] for i in pick])
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    after = held_out_loss()
    model.eval().save_pretrained(path)
    report = {"steps": steps, "batch": batch, "seq_len": seq_len, "lr": lr, "train_rows": len(train),
              "held_out_rows": len(test), "held_out_loss_before": round(before, 4),
              "held_out_loss_after": round(after, 4), "uniform_loss": round(math.log(len(tok)), 4),
              "seconds": round(time.time() - t0, 1)}
    (path / "tiny_training.json").write_text(json.dumps(report, indent=2))
    return report


def build_all(out: Path, seed: int = 0, train_steps: int = 250) -> dict[str, Path]:
    """Corpus, tokenizer and target under `out`; reuses what is already there."""
    out = Path(out)
    corpus = out / "corpus" / "chat.jsonl"
    target = out / "tiny-target"
    rows = stdlib_chat_pairs()
    random.Random(seed).shuffle(rows)
    if not corpus.exists():
        corpus.parent.mkdir(parents=True, exist_ok=True)
        tmp = corpus.with_suffix(".tmp")
        with tmp.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        tmp.replace(corpus)
    if not (target / "tiny_training.json").exists():
        texts = [m["content"] for r in rows for m in r["messages"]]
        tok = build_tokenizer(texts, target)
        build_target(tok, target, seed=seed)
        if train_steps:
            # the corpus is shuffled with the seed: its first rows are the held-out ones
            report = train_target(target, rows, steps=train_steps, seed=seed)
            print(f"tiny target held-out loss {report['held_out_loss_before']:.3f} -> "
                  f"{report['held_out_loss_after']:.3f} (uniform {report['uniform_loss']:.3f}) "
                  f"in {report['seconds']:.0f}s")
    return {"corpus": corpus, "target": target}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="build", help="output folder (default: build)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-steps", type=int, default=250, help="training steps of the tiny target (0: random)")
    args = ap.parse_args()
    paths = build_all(Path(args.out), seed=args.seed, train_steps=args.train_steps)
    n = sum(1 for _ in open(paths["corpus"]))
    print(f"corpus: {paths['corpus']} ({n} chat rows)\ntarget: {paths['target']}")


if __name__ == "__main__":
    main()
