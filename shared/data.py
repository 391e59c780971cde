"""DATA -> token ids and loss masks.

DATA is a .jsonl/.json/.parquet file (.jsonl.gz, .json.gz too), a glob of them, a folder of
them, or a folder written by `datasets.save_to_disk`; a .json array cut off mid-record (ShareGPT's
packaged copy) is read record by record up to the break. Rows are chats (`messages` or
`conversations`; role/content or ShareGPT from/value; reasoning as `reasoning_content`,
`reasoning` or inline <think>) rendered with the target's chat template, prompt sets (MT-Bench's
`turns`, HumanEval's `prompt`: user turns only, answered by regeneration), or plain `text`. A chat's loss covers what the model writes in each
assistant turn, through its end-of-turn token, after exactly the context serving gives it
(shared/chat.py); a multi-turn chat may become several samples. Plain text: every token.
"""

from __future__ import annotations

import codecs
import gzip
import glob as globlib
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from shared.chat import ChatError, ChatRenderer, ChatSamples, Sample
from shared.named_data import NAMED, NamedDataError, named_path

SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")


def _data_suffix(p: Path) -> str | None:
    """The DATA suffix a file name ends with (".jsonl.gz" before ".gz"), or None."""
    return next((x for x in sorted(SUFFIXES, key=len, reverse=True) if p.name.endswith(x)), None)
# the fields a chat row is read from, in this order: chats, then prompt sets (user turns only)
CHAT_FIELDS = ("messages", "conversations", "turns", "prompt")
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
    kept: int = 0                 # rows with at least one sample
    samples: int = 0
    truncated: int = 0            # samples cut at the max length
    turns: int = 0                # assistant turns trained (chat rows)
    turns_split: int = 0          # trained in a sample with their own serving context
    turns_context: int = 0        # kept as context without loss (--inexact-turns context)
    split_tokens: int = 0         # tokens of those extra samples: what splitting costs
    skipped: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)  # reason -> first message

    def skip(self, err: RowError):
        self.skipped[err.reason] += 1
        self.examples.setdefault(err.reason, str(err))

    def add(self, chat: ChatSamples, samples: int, truncated: int):
        self.kept += 1
        self.samples += samples
        self.truncated += truncated
        self.turns += chat.turns
        self.turns_split += chat.split
        self.turns_context += chat.context
        self.split_tokens += chat.split_tokens

    def to_dict(self) -> dict:
        return {"rows": self.rows, "kept": self.kept, "samples": self.samples, "truncated": self.truncated,
                "turns": self.turns, "turns_split": self.turns_split, "turns_context": self.turns_context,
                "split_tokens": self.split_tokens, "skipped": dict(self.skipped), "examples": self.examples}


def _is_saved_dataset(p: Path) -> bool:
    """A folder written by `datasets.save_to_disk` (a Dataset or a DatasetDict)."""
    return (p / "dataset_dict.json").exists() or ((p / "dataset_info.json").exists() and (p / "state.json").exists())


def _folder_sources(p: Path) -> list[Path]:
    """Data files and save_to_disk folders under p: a saved dataset is one source, and its own
    metadata files (dataset_info.json, state.json, ...) are never read as data rows."""
    if _is_saved_dataset(p):
        return [p]
    out = []
    for child in sorted(p.iterdir()):
        if child.is_dir():
            out += _folder_sources(child)
        elif _data_suffix(child):
            out.append(child)
    return out


def resolve(data: str) -> list[Path]:
    """The sources that DATA names (files, and save_to_disk folders, or a registry set by name:
    shared/named_data.py), in a stable order."""
    p = Path(data)
    if data in NAMED and not p.exists():
        try:
            return [named_path(data)]
        except NamedDataError as e:
            raise DataError(f"DATA {data}: {e}") from None
    if p.is_dir():
        files = _folder_sources(p)
        if not files:
            raise DataError(f"DATA {data}: folder has no {'/'.join(SUFFIXES)} files and is not a "
                            f"datasets.save_to_disk folder")
        return files
    if p.is_file():
        if not _data_suffix(p):
            raise DataError(f"DATA {data}: unsupported file type {p.suffix!r} (use {', '.join(SUFFIXES)})")
        return [p]
    if any(c in data for c in "*?["):
        files = sorted(Path(f) for f in globlib.glob(data, recursive=True) if _data_suffix(Path(f)))
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
        raw = f.read_bytes()
        if f.name.endswith(".gz"):  # HumanEval ships HumanEval.jsonl.gz
            try:
                raw = gzip.decompress(raw)
            except (OSError, EOFError) as e:
                raise DataError(f"DATA {f}: not a readable gzip file ({e})") from None
        if raw.startswith(codecs.BOM_UTF8):  # UTF-8 with a byte-order mark (Windows editors)
            raw = raw[len(codecs.BOM_UTF8):]
        if _data_suffix(f).startswith(".json") and not _data_suffix(f).startswith(".jsonl") \
                and raw.lstrip().startswith(b"["):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"DATA {f}: not UTF-8 (byte {e.start}: {raw[e.start:e.start + 4]!r})") from None
            yield from ((fi, ri, w, row) for ri, w, row in _json_array_rows(f, text))
            continue
        # JSON Lines ends a row at LF only: bytes.splitlines() would also split at a lone CR (or
        # other separators), which is no row end, and shift every line number after it.
        for ri, bline in enumerate(raw.split(b"\n")):
            where = f"{f} line {ri + 1}"
            if not bline.strip():
                continue
            try:
                line = bline.decode("utf-8")
            except UnicodeDecodeError as e:
                # Skipped, not repaired: U+FFFD in place of the bytes would train the drafter on
                # text the target never sees at serving time.
                yield fi, ri, where, RowError("invalid_utf8", where, f"bytes that are not UTF-8 at column "
                                                                     f"{e.start + 1} ({bline[e.start:e.start + 4]!r})")
                continue
            try:
                yield fi, ri, where, json.loads(line)
            except json.JSONDecodeError as e:
                yield fi, ri, where, RowError("malformed_json", where, f"malformed JSON ({e.msg} at column {e.colno})")


def _json_array_rows(f: Path, text: str) -> Iterator[tuple[int, str, dict | RowError]]:
    """The records of a JSON array, one at a time. A file cut off mid-record (ShareGPT's packaged
    copy is) yields every complete record, then one `truncated_json` row error naming where the
    broken tail starts; a malformed record elsewhere is an error for the whole file."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as whole:
        dec, pos, ri = json.JSONDecoder(), text.index("[") + 1, 0
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] == "]":
                # the array is complete record by record, yet json.loads failed: say where
                raise DataError(f"DATA {f}: invalid JSON at line {whole.lineno} column {whole.colno}: "
                                f"{whole.msg}") from None
            try:
                row, end = dec.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                if text[pos:].strip() and json_cut_off(text[pos:]):
                    where = f"{f} row {ri}"
                    yield ri, where, RowError("truncated_json", where, f"the file ends inside this record "
                                              f"(at character {pos:,} of {len(text):,}): {ri} complete "
                                              f"record(s) before it are read")
                    return
                raise DataError(f"DATA {f}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
            yield ri, f"{f} row {ri}", row
            ri, pos = ri + 1, end
    for ri, row in enumerate(rows):
        yield ri, f"{f} row {ri}", row


def json_cut_off(tail: str) -> bool:
    """Whether a JSON value that fails to parse is one cut off at the end of the text (its parse
    fails only because the text ends), not one malformed in the middle."""
    try:
        json.loads(tail)
    except json.JSONDecodeError as e:
        return e.pos >= len(tail.rstrip()) - 1 or "Unterminated string" in e.msg
    return False


def _content(value, where: str, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"type": "text", "text": ...}, ...]
        parts = [p.get("text", "") for p in value if isinstance(p, dict)]
        if parts:
            return "".join(parts)
    raise RowError("bad_field", where, f"field messages[{i}].content is not text ({type(value).__name__})")


def _tool_calls(value, where: str, i: int) -> list[dict]:
    """Tool calls in the transformers chat format: [{"type": "function", "function": {"name",
    "arguments"}}]; also accepts the flat {"name", "arguments"} some datasets use."""
    if not isinstance(value, list) or not value:
        raise RowError("bad_field", where, f"field messages[{i}].tool_calls is not a non-empty list")
    out = []
    for j, c in enumerate(value):
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError("bad_field", where, f"field messages[{i}].tool_calls[{j}] has no function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # JSON text: templates render a dict with tojson
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as text; the templates print strings as they are
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c, dict) and "id" in c:
            call["id"] = c["id"]
        out.append(call)
    return out


def normalize_chat(row: dict, where: str, require_assistant: bool = True) -> list[dict] | None:
    """Messages in the transformers chat format from `messages` or `conversations` (role/content
    or ShareGPT from/value), tool calls and tool results included; from `turns` (MT-Bench: user
    turns) or `prompt` (HumanEval: the code prompt as the user message, verbatim); None if the row
    is plain text. require_assistant=False accepts prompt-only chats (regeneration writes their
    answers)."""
    key = next((k for k in CHAT_FIELDS if k in row), None)
    if key is None:
        if "text" in row:
            return None
        raise RowError("bad_field", where, f"no {', '.join(repr(k) for k in CHAT_FIELDS)} or 'text' field "
                                           f"(fields: {sorted(row)})")
    msgs = row[key]
    if key in ("turns", "prompt"):  # prompt sets: MT-Bench's user turns, HumanEval's code prompt
        msgs = [msgs] if key == "prompt" and isinstance(msgs, str) else msgs
        if not isinstance(msgs, list) or not all(isinstance(t, str) for t in msgs):
            raise RowError("bad_field", where, f"field '{key}' is not {'a string' if key == 'prompt' else 'a list of strings'}")
        msgs = [{"role": "user", "content": t} for t in msgs]
    if not isinstance(msgs, list):
        raise RowError("bad_field", where, f"field '{key}' is not a list of messages ({type(msgs).__name__})")
    if not msgs:
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
        msg = {"role": role}
        if m.get("tool_calls"):
            if role != "assistant":
                raise RowError("bad_field", where, f"field {key}[{i}] has tool_calls but role {role!r}")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where, i)
        if content is None and "tool_calls" not in msg:
            raise RowError("bad_field", where, f"field {key}[{i}] has no content")
        msg["content"] = "" if content is None else _content(content, where, i)
        for extra in ("name", "tool_call_id"):
            if isinstance(m.get(extra), str):
                msg[extra] = m[extra]
        # reasoning: `reasoning_content` (transformers, SGLang, older vLLM) or `reasoning` (newer vLLM,
        # which hands it to the template as reasoning_content too)
        reasoning = next((m[k] for k in ("reasoning_content", "reasoning") if isinstance(m.get(k), str)), None)
        if reasoning is not None and role == "assistant":
            msg["reasoning_content"] = reasoning
        out.append(msg)
    if not require_assistant:
        return out
    if not any(m["role"] == "assistant" for m in out):
        raise RowError("no_assistant_turn", where, f"field '{key}' has no assistant turn")
    if all(not m["content"].strip() and "tool_calls" not in m and not m.get("reasoning_content", "").strip()
           for m in out if m["role"] == "assistant"):
        raise RowError("empty_conversation", where, "every assistant turn is empty")
    return out


class Encoder:
    """Rows -> token samples with loss masks, for one tokenizer, with the chat template options
    serving uses (`template_kwargs`, e.g. {"enable_thinking": False}). Chats go through
    shared/chat.py: each assistant turn is trained after exactly its serving context;
    `inexact`/`drop_reasoning` are its options."""

    def __init__(self, tokenizer, max_len: int, too_long: str, template_kwargs: dict | None = None,
                 inexact: str = "split", drop_reasoning: bool = False):
        self.tok = tokenizer
        self.max_len, self.too_long = max_len, too_long
        self.chat = ChatRenderer(tokenizer, template_kwargs, inexact, drop_reasoning)

    def prompt(self, msgs: list[dict], tools=None) -> str:
        """The text the target sees before it writes the next assistant turn."""
        try:
            return self.chat.prompt(msgs, tools)
        except ChatError as e:
            raise RowError(e.reason, "prompt", str(e)) from None

    def render(self, row: dict, where: str) -> ChatSamples:
        """A row's samples as token ids and loss runs (a plain text row: one sample, all loss)."""
        if not isinstance(row, dict):
            raise RowError("bad_field", where, f"row is a {type(row).__name__}, not an object")
        msgs = normalize_chat(row, where)
        if msgs is None:
            text = row["text"]
            if not isinstance(text, str):
                raise RowError("bad_field", where, "field 'text' is not a string")
            if not text.strip():
                raise RowError("empty_conversation", where, "field 'text' is empty")
            ids = self.chat.ids(text)
            return ChatSamples([Sample(ids, [(0, len(ids))])], 0)
        tools = row.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RowError("bad_field", where, "field 'tools' is not a list")
        try:
            out = self.chat.samples(msgs, tools)
        except ChatError as e:
            raise RowError(e.reason, where, str(e)) from None
        if not out.samples:
            raise RowError("no_loss_tokens", where, "no assistant turn answers a user message")
        return out

    def encode(self, row: dict, where: str) -> tuple[list[tuple[np.ndarray, np.ndarray, bool]], ChatSamples]:
        """[(input_ids int32, loss_mask uint8, truncated)] per sample, and the row's chat counts.
        A sample left without two consecutive loss tokens by truncation is dropped."""
        rendered = self.render(row, where)
        out, cut = [], False
        for s in rendered.samples:
            ids = np.asarray(s.ids, dtype=np.int32)
            mask = np.zeros(len(ids), dtype=np.uint8)
            for a, b in s.runs:
                mask[a:b] = 1
            truncated = len(ids) > self.max_len
            cut |= truncated
            if truncated:
                if self.too_long == "skip":
                    raise RowError("too_long", where, f"{len(ids)} tokens > max length {self.max_len}")
                ids, mask = ids[:self.max_len], mask[:self.max_len]
            # A drafter needs a position p with loss at p and p+1 (docs/DESIGN.md, "The training step").
            if (mask[:-1] & mask[1:]).any():
                out.append((ids, mask, truncated))
        if not out:
            raise RowError("no_loss_tokens", where, "fewer than 2 consecutive assistant tokens"
                                                    + (" after truncation" if cut else ""))
        return out, rendered


def encode_all(data: str, tokenizer, max_len: int, too_long: str, progress: bool = True,
               template_kwargs: dict | None = None, inexact: str = "split", drop_reasoning: bool = False,
               max_rows: int = 0):
    """Every usable row of DATA (of its first max_rows rows, 0 = all), encoded (one or more
    samples each), with a report of what was skipped and why and what the chats cost in samples."""
    from shared.progress import progress_bar
    files = resolve(data)
    enc, report, out = Encoder(tokenizer, max_len, too_long, template_kwargs, inexact, drop_reasoning), Report(), []
    for fi, ri, where, row in progress_bar(iter_rows(files), desc="tokenize", unit=" rows", disable=not progress):
        if max_rows and report.rows >= max_rows:
            break
        report.rows += 1
        try:
            if isinstance(row, RowError):
                raise row
            samples, chat = enc.encode(row, where)
        except RowError as e:
            report.skip(e)
            continue
        report.add(chat, len(samples), sum(t for _, _, t in samples))
        out += [Encoded(ids, mask, fi, ri) for ids, mask, _ in samples]
    if not out:
        detail = "; ".join(f"{k}: {v} (e.g. {report.examples[k]})" for k, v in report.skipped.items())
        raise DataError(f"DATA {data}: no usable rows out of {report.rows}" + (f" ({detail})" if detail else ""))
    return files, out, report
