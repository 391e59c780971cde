"""DATA -> token ids and loss masks.

DATA is a .jsonl/.json/.parquet file, a glob of them, a folder of them, or a folder written by
`datasets.save_to_disk`. Rows are chats (`messages` or `conversations`; role/content or ShareGPT
from/value) rendered with the target's chat template, or plain `text`. The loss mask covers the
assistant tokens and the end-of-turn token that closes each assistant turn; for plain text it
covers every token.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

SUFFIXES = (".jsonl", ".json", ".parquet")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function": "tool"}


class DataError(RuntimeError):
    """DATA cannot be read at all (missing path, no rows)."""


class RowError(ValueError):
    """One row is unusable; it is counted under `reason` and skipped."""

    def __init__(self, reason: str, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.reason = reason


@dataclass
class Encoded:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    file: int
    row: int


@dataclass
class Report:
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)  # reason -> first message

    def skip(self, err: RowError):
        self.skipped[err.reason] += 1
        self.examples.setdefault(err.reason, str(err))


def resolve(data: str) -> list[Path]:
    """The files (or one save_to_disk folder) that DATA names, in a stable order."""
    p = Path(data)
    if p.is_dir():
        if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            return [p]
        files = sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES)
        if not files:
            raise DataError(f"DATA {data}: folder has no {'/'.join(SUFFIXES)} files and is not a "
                            f"datasets.save_to_disk folder")
        return files
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise DataError(f"DATA {data}: unsupported file type {p.suffix!r} (use {', '.join(SUFFIXES)})")
        return [p]
    if any(c in data for c in "*?["):
        files = sorted(Path(f) for f in globlib.glob(data, recursive=True) if Path(f).suffix in SUFFIXES)
        if not files:
            raise DataError(f"DATA {data}: the glob matches no {'/'.join(SUFFIXES)} file")
        return files
    raise DataError(f"DATA {data}: no such file or folder")


def describe(files: list[Path]) -> list[dict]:
    """Name, size and content hash of each source, for the manifest and the resume check."""
    out = []
    for f in files:
        h = hashlib.sha256()
        paths = [f] if f.is_file() else sorted(x for x in f.rglob("*") if x.is_file())
        size = 0
        for x in paths:
            with x.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
            size += x.stat().st_size
        out.append({"path": str(f), "bytes": size, "sha256": h.hexdigest()})
    return out


def iter_rows(files: list[Path]) -> Iterator[tuple[int, int, str, dict | RowError]]:
    """(file index, row index, "file:row" label, row dict or RowError) for every row."""
    for fi, f in enumerate(files):
        if f.is_dir() or f.suffix == ".parquet":
            import datasets
            if f.is_dir():
                ds = datasets.load_from_disk(str(f))
                if isinstance(ds, datasets.DatasetDict):
                    if "train" not in ds:
                        raise DataError(f"DATA {f}: a DatasetDict without a 'train' split "
                                        f"(splits: {list(ds)})")
                    ds = ds["train"]
            else:
                ds = datasets.load_dataset("parquet", data_files=str(f), split="train")
            for ri, row in enumerate(ds):
                yield fi, ri, f"{f} row {ri}", row
            continue
        # JSON lines are parsed here rather than by datasets so that one malformed line is
        # reported with its line number and skipped, instead of failing the whole file.
        text = f.read_text(encoding="utf-8", errors="replace")
        if f.suffix == ".json" and text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"DATA {f}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
            for ri, row in enumerate(rows):
                yield fi, ri, f"{f} row {ri}", row
            continue
        for ri, line in enumerate(text.splitlines()):
            where = f"{f} line {ri + 1}"
            if not line.strip():
                continue
            try:
                yield fi, ri, where, json.loads(line)
            except json.JSONDecodeError as e:
                yield fi, ri, where, RowError("malformed_json", where, f"malformed JSON ({e.msg} at column {e.colno})")


def _content(value, where: str, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"type": "text", "text": ...}, ...]
        parts = [p.get("text", "") for p in value if isinstance(p, dict)]
        if parts:
            return "".join(parts)
    raise RowError("bad_field", where, f"field messages[{i}].content is not text ({type(value).__name__})")


def normalize_chat(row: dict, where: str) -> list[dict] | None:
    """role/content messages from `messages` or `conversations`; None if the row is plain text."""
    key = "messages" if "messages" in row else "conversations" if "conversations" in row else None
    if key is None:
        if "text" in row:
            return None
        raise RowError("bad_field", where, f"no 'messages', 'conversations' or 'text' field "
                                           f"(fields: {sorted(row)})")
    msgs = row[key]
    if not isinstance(msgs, list) or not msgs:
        raise RowError("empty_conversation", where, f"field '{key}' is empty")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RowError("bad_field", where, f"field {key}[{i}] is not an object")
        if "role" in m:
            role, content = m["role"], m.get("content")
        elif "from" in m:
            role, content = SHAREGPT_ROLES.get(m["from"]), m.get("value")
            if role is None:
                raise RowError("bad_field", where, f"field {key}[{i}].from has unknown role {m['from']!r}")
        else:
            raise RowError("bad_field", where, f"field {key}[{i}] has neither 'role' nor 'from'")
        if content is None:
            raise RowError("bad_field", where, f"field {key}[{i}] has no content")
        out.append({"role": role, "content": _content(content, where, i)})
    if not any(m["role"] == "assistant" for m in out):
        raise RowError("no_assistant_turn", where, f"field '{key}' has no assistant turn")
    if all(not m["content"].strip() for m in out if m["role"] == "assistant"):
        raise RowError("empty_conversation", where, "every assistant turn is empty")
    return out


class Encoder:
    """Renders and tokenizes rows for one tokenizer."""

    def __init__(self, tokenizer, max_len: int, too_long: str):
        self.tok = tokenizer
        self.max_len, self.too_long = max_len, too_long
        eot = "<|im_end|>" if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token
        self.eot = eot or ""

    def render(self, row: dict, where: str) -> tuple[str, list[tuple[int, int]] | None]:
        """Text to tokenize and the character spans that carry loss (None: all of it)."""
        if not isinstance(row, dict):
            raise RowError("bad_field", where, f"row is a {type(row).__name__}, not an object")
        msgs = normalize_chat(row, where)
        if msgs is None:
            text = row["text"]
            if not isinstance(text, str):
                raise RowError("bad_field", where, "field 'text' is not a string")
            if not text.strip():
                raise RowError("empty_conversation", where, "field 'text' is empty")
            return text, None
        try:
            text = self.tok.apply_chat_template(msgs, tokenize=False)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise RowError("template_error", where, f"chat template failed: {e}") from None
        spans, cursor = [], 0
        for m in msgs:
            if m["role"] != "assistant" or not m["content"]:
                continue
            start = text.find(m["content"], cursor)
            if start < 0:
                raise RowError("template_error", where, "assistant content not found verbatim in the "
                                                        "rendered chat (the template rewrites it)")
            end = start + len(m["content"])
            if self.eot and text.startswith(self.eot, end):
                end += len(self.eot)  # the end-of-turn token is what the drafter must learn to stop on
            spans.append((start, end))
            cursor = end
        return text, spans

    def encode(self, row: dict, where: str) -> tuple[np.ndarray, np.ndarray, bool]:
        text, spans = self.render(row, where)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=spans is not None)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        if spans is None:
            mask = np.ones(len(ids), dtype=np.uint8)
        else:
            offs = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
            mask = np.zeros(len(ids), dtype=np.uint8)
            for s, e in spans:
                mask |= ((offs[:, 0] < e) & (offs[:, 1] > s)).astype(np.uint8)
        truncated = False
        if len(ids) > self.max_len:
            if self.too_long == "skip":
                raise RowError("too_long", where, f"{len(ids)} tokens > max length {self.max_len}")
            ids, mask, truncated = ids[:self.max_len], mask[:self.max_len], True
        # A drafter needs a position p with loss at p and p+1 (DESIGN.md section 4).
        if not (mask[:-1] & mask[1:]).any():
            raise RowError("no_loss_tokens", where, "fewer than 2 consecutive assistant tokens"
                                                    + (" after truncation" if truncated else ""))
        return ids, mask, truncated


def encode_all(data: str, tokenizer, max_len: int, too_long: str, progress: bool = True):
    """Every usable row of DATA, encoded, with a report of what was skipped and why."""
    from shared.progress import progress_bar
    files = resolve(data)
    enc, report, out = Encoder(tokenizer, max_len, too_long), Report(), []
    for fi, ri, where, row in progress_bar(iter_rows(files), desc="tokenize", unit=" rows", disable=not progress):
        report.rows += 1
        try:
            if isinstance(row, RowError):
                raise row
            ids, mask, truncated = enc.encode(row, where)
        except RowError as e:
            report.skip(e)
            continue
        report.kept += 1
        report.truncated += truncated
        out.append(Encoded(ids, mask, fi, ri))
    if not out:
        detail = "; ".join(f"{k}: {v} (e.g. {report.examples[k]})" for k, v in report.skipped.items())
        raise DataError(f"DATA {data}: no usable rows out of {report.rows}" + (f" ({detail})" if detail else ""))
    return files, out, report
