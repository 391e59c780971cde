"""One way to build a CLI: from a typed config dataclass, as torchtitan derives its CLI from its
config classes. Every field becomes `--field-name` with its real type: bool -> --x/--no-x,
Literal -> choices, list[int] -> "1,2,3", X | None -> optional. Per-field help and an optional
parser/flag name come from the field's metadata (see `opt`)."""

from __future__ import annotations

import argparse
import json
import types
from dataclasses import MISSING, field, fields
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints


def opt(default: Any = MISSING, help: str = "", *, flag: str | None = None, parse: Callable | None = None,
        cli: bool = True, repeat: bool = False, default_factory: Callable | None = None):
    """A dataclass field with its CLI help (and, rarely, its own flag name or parser). repeat: a
    list[str] given as the flag repeated (values that hold commas), not as one comma list."""
    meta = {"help": help, "flag": flag, "parse": parse, "cli": cli, "repeat": repeat}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta) if default is not MISSING else field(metadata=meta)


def _unwrap_optional(t):
    if get_origin(t) in (Union, types.UnionType):
        args = [a for a in get_args(t) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return t


def _list_parser(elem):
    def parse(s: str):
        try:
            return [elem(x) for x in s.split(",") if x.strip()] or None
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {elem.__name__}, got {s!r}")
    return parse


def _arg_type(fn):
    """argparse shows an ArgumentTypeError's own message; a plain ValueError becomes 'invalid value'."""
    def parse(s: str):
        try:
            return fn(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = fn.__name__
    return parse


def add_arguments(ap: argparse.ArgumentParser, cls) -> None:
    hints = get_type_hints(cls)
    for f in fields(cls):
        meta = f.metadata
        if meta.get("cli") is False:
            continue
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        required = f.default is MISSING and f.default_factory is MISSING
        default = None if required else (f.default if f.default is not MISSING else f.default_factory())
        help_ = meta.get("help", "") or ""
        if not required and default not in (None, [], False) and not isinstance(default, bool):
            help_ += f" (default: {','.join(map(str, default)) if isinstance(default, list) else default})"
        kw: dict = {"dest": f.name, "help": help_}
        t = _unwrap_optional(hints[f.name])
        if meta.get("parse"):
            kw.update(type=_arg_type(meta["parse"]), default=default, required=required)
        elif t is bool:
            kw.update(action=argparse.BooleanOptionalAction, default=default)
        elif get_origin(t) is Literal:
            choices = get_args(t)
            kw.update(choices=choices, type=type(choices[0]), default=default, required=required)
        elif get_origin(t) is list and meta.get("repeat"):
            kw.update(action="append", type=get_args(t)[0], default=None, required=required)
        elif get_origin(t) is list:
            kw.update(type=_list_parser(get_args(t)[0]), default=default, required=required)
        else:
            kw.update(type=t, default=default, required=required)
        ap.add_argument(flag, **kw)


def from_args(cls, ns: argparse.Namespace):
    kw = {f.name: getattr(ns, f.name) for f in fields(cls) if f.metadata.get("cli") is not False}
    for f in fields(cls):  # a repeated flag never given: its default (argparse would append to a shared one)
        if f.metadata.get("repeat") and kw.get(f.name) is None:
            kw.pop(f.name)
    return cls(**kw)


def parser_for(cls, prog: str, doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap, cls)
    return ap


# --- parsers of option values shared by the stages -------------------------------------------

def parse_gpus(spec: str | None) -> list[int]:
    """"0,1" -> [0, 1]; "" -> [] (CPU). Checked against the GPUs that exist."""
    if spec is None or str(spec).strip() == "":
        return []
    try:
        ids = [int(x) for x in str(spec).split(",") if x.strip() != ""]
    except ValueError:
        raise ValueError(f"GPUS={spec!r}: expected a comma-separated list of GPU numbers, e.g. 0,1") from None
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPUS={spec!r}: a GPU is listed twice")
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    bad = [i for i in ids if i < 0 or i >= n]
    if bad:
        raise ValueError(f"GPUS={spec!r}: GPU {bad} does not exist (this machine has {n} GPU"
                         f"{'s' if n != 1 else ''}{': 0..' + str(n - 1) if n else ''})")
    return ids


def parse_json_object(spec: str) -> dict:
    """'{"enable_thinking": false}' -> dict (the chat template's keyword arguments)."""
    try:
        value = json.loads(spec) if spec.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"expected a JSON object, e.g. '{{\"enable_thinking\": false}}' ({e.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def exit_interrupted(message: str):
    """Ctrl-C in a stage whose worker runs on a thread of this process: one line, then out at
    once. Child processes (writers, spawned workers: they ignore SIGINT) are terminated first;
    the interpreter's own shutdown is skipped, because tearing down torch under a thread still
    inside a kernel aborts the process with a C++ error. Nothing is lost: every store and output
    write is atomic, and a rerun resumes."""
    import multiprocessing
    import os
    import sys
    print(message, file=sys.stderr, flush=True)
    for p in multiprocessing.active_children():
        p.terminate()
    for p in multiprocessing.active_children():
        p.join(timeout=10)
    sys.stdout.flush()
    os._exit(130)


def refuse_below(cfg, names: tuple[str, ...], low: int, error: type[Exception] = ValueError, hint: str = ""):
    """The first of cfg's options `names` under `low` (0 or 1), refused as its --flag with the value;
    an option left out (None) is not checked."""
    what = "at least 1" if low == 1 else "0 or more"
    for name in names:
        v = getattr(cfg, name)
        if v is not None and v < low:
            raise error(f"--{name.replace('_', '-')} must be {what}, not {v}{hint}")

