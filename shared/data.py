"""DATA -> token ids and loss masks.

DATA is a .jsonl/.json/.parquet file, a glob of them, a folder of them, or a folder written by
`datasets.save_to_disk`. Rows are chats (`messages` or `conversations`; role/content or ShareGPT
from/value) rendered with the target's chat template, or plain `text`. The loss mask covers the
assistant tokens and the end-of-turn token that closes each assistant turn; for plain text it
covers every token.
"""

from __future__ import annotations

import codecs
import glob as globlib
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from shared.target import end_of_turn

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
        elif child.suffix in SUFFIXES:
            out.append(child)
    return out


def resolve(data: str) -> list[Path]:
    """The sources that DATA names (files, and save_to_disk folders), in a stable order."""
    p = Path(data)
    if p.is_dir():
        files = _folder_sources(p)
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
        raw = f.read_bytes()
        if raw.startswith(codecs.BOM_UTF8):  # UTF-8 with a byte-order mark (Windows editors)
            raw = raw[len(codecs.BOM_UTF8):]
        if f.suffix == ".json" and raw.lstrip().startswith(b"["):
            try:
                rows = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"DATA {f}: not UTF-8 (byte {e.start}: {raw[e.start:e.start + 4]!r})") from None
            except json.JSONDecodeError as e:
                raise DataError(f"DATA {f}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
            for ri, row in enumerate(rows):
                yield fi, ri, f"{f} row {ri}", row
            continue
        for ri, bline in enumerate(raw.splitlines()):
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
    or ShareGPT from/value), tool calls and tool results included; None if the row is plain text.
    require_assistant=False accepts prompt-only chats (regeneration writes their answer)."""
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
        msg = {"role": role}
        if m.get("tool_calls"):
            if role != "assistant":
                raise RowError("bad_field", where, f"field {key}[{i}] has tool_calls but role {role!r}")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where, i)
        if content is None and "tool_calls" not in msg:
            raise RowError("bad_field", where, f"field {key}[{i}] has no content")
        msg["content"] = "" if content is None else _content(content, where, i)
        for extra in ("name", "tool_call_id", "reasoning_content"):
            if isinstance(m.get(extra), str):
                msg[extra] = m[extra]
        out.append(msg)
    if not require_assistant:
        return out
    if not any(m["role"] == "assistant" for m in out):
        raise RowError("no_assistant_turn", where, f"field '{key}' has no assistant turn")
    if all(not m["content"].strip() and "tool_calls" not in m for m in out if m["role"] == "assistant"):
        raise RowError("empty_conversation", where, "every assistant turn is empty")
    return out


class Encoder:
    """Renders and tokenizes rows for one tokenizer, with the chat template options
    (`template_kwargs`, e.g. {"enable_thinking": False}) that serving will use."""

    def __init__(self, tokenizer, max_len: int, too_long: str, template_kwargs: dict | None = None):
        self.tok = tokenizer
        self.max_len, self.too_long = max_len, too_long
        self.template_kwargs = dict(template_kwargs or {})
        self.eot = end_of_turn(tokenizer)[0]

    def _apply(self, msgs, where: str, **kw) -> str:
        try:
            return self.tok.apply_chat_template(msgs, tokenize=False, **self.template_kwargs, **kw)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise RowError("template_error", where, f"chat template failed: {e}") from None

    def prompt(self, msgs: list[dict], tools=None) -> str:
        """The text the target sees before it writes the next assistant turn."""
        return self._apply(msgs, "prompt", add_generation_prompt=True, **({"tools": tools} if tools else {}))

    def render(self, row: dict, where: str) -> tuple[str, list[tuple[int, int]] | None]:
        """Text to tokenize and the character spans that carry loss (None: all of it).

        An assistant turn's loss span is what the model writes there: the render of the
        conversation up to and including the turn, minus the render of the conversation before
        it with the generation prompt (so tool calls, and whatever the template puts in the
        prompt such as an empty think block, land on the right side), cut after its end-of-turn
        token. Templates that render earlier turns otherwise than the last one (Qwen3 drops old
        reasoning) fall back to the turn's own content, found verbatim."""
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
        tools = row.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RowError("bad_field", where, "field 'tools' is not a list")
        kw = {"tools": tools} if tools else {}
        text = self._apply(msgs, where, **kw)
        spans, cursor = [], 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            for call in m.get("tool_calls", ()):
                if call["function"]["name"] not in text:
                    raise RowError("template_error", where, "the chat template does not render tool calls "
                                                            f"(messages[{i}] calls {call['function']['name']!r})")
            before = self._apply(msgs[:i], where, add_generation_prompt=True, **kw)
            upto = self._apply(msgs[:i + 1], where, **kw)
            seg = upto[len(before):] if upto.startswith(before) else ""
            start = text.find(seg, cursor) if seg.strip() else -1
            if start >= 0:
                cut = seg.rfind(self.eot) if self.eot else -1
                end = start + (cut + len(self.eot) if cut >= 0 else len(seg.rstrip()))
            else:
                if not m["content"]:
                    if "tool_calls" in m:
                        raise RowError("template_error", where, f"messages[{i}]: the tool call's text cannot "
                                                                "be located in the rendered chat")
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
        # A drafter needs a position p with loss at p and p+1 (docs/DESIGN.md, "The training step").
        if not (mask[:-1] & mask[1:]).any():
            raise RowError("no_loss_tokens", where, "fewer than 2 consecutive assistant tokens"
                                                    + (" after truncation" if truncated else ""))
        return ids, mask, truncated


def encode_all(data: str, tokenizer, max_len: int, too_long: str, progress: bool = True,
               template_kwargs: dict | None = None):
    """Every usable row of DATA, encoded, with a report of what was skipped and why."""
    from shared.progress import progress_bar
    files = resolve(data)
    enc, report, out = Encoder(tokenizer, max_len, too_long, template_kwargs), Report(), []
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
