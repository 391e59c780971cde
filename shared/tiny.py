"""The built-in default: a tiny Qwen3.5-style hybrid target, its tokenizer and a chat corpus.

Nothing is downloaded. The corpus is made from the Python standard library's own source
(every machine with Python has it): each function with a docstring becomes a chat pair
"write a function that <docstring>" -> its source. The tokenizer is a byte-level BPE trained
on that corpus; the target is an 8-layer `qwen3_5_text` model (6 Gated DeltaNet layers and 2
full-attention layers) with random weights, saved as an ordinary HF checkpoint directory.

    python -m shared.tiny --out build
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

# ChatML, as the Qwen family renders it. Kept minimal: roles and content only.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
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


def build_all(out: Path, seed: int = 0) -> dict[str, Path]:
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
    if not (target / "config.json").exists():
        texts = [m["content"] for r in rows for m in r["messages"]]
        tok = build_tokenizer(texts, target)
        build_target(tok, target, seed=seed)
    return {"corpus": corpus, "target": target}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="build", help="output folder (default: build)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    paths = build_all(Path(args.out), seed=args.seed)
    n = sum(1 for _ in open(paths["corpus"]))
    print(f"corpus: {paths['corpus']} ({n} chat rows)\ntarget: {paths['target']}")


if __name__ == "__main__":
    main()
