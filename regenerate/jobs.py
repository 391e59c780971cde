"""Source rows as regeneration jobs: the prompt turns kept, the assistant turns to write, in order."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from regenerate.config import RegenConfig
from shared.chat import THINK_END, split_reasoning
from shared.data import DataError, RowError, describe, iter_rows, normalize_chat, resolve


@dataclass
class Reply:
    text: str
    finish_reason: str            # "stop" | "length" | "error" (the row is skipped, `error` says why)
    tokens: int
    tool_calls: list | None = None
    error: tuple[str, str] | None = None  # (reason, message) when the row cannot be answered
    reasoning: str | None = None  # the turn's thinking, apart from its content (as templates take it back)

    @classmethod
    def of_text(cls, text: str, finish_reason: str, tokens: int) -> "Reply":
        """A locally generated turn: thinking the model closed with </think> (after a generation
        prompt that opened it) becomes reasoning_content, as a server's reasoning parser returns it."""
        reasoning, content = split_reasoning(text)
        return cls(content, finish_reason, tokens, reasoning=reasoning if THINK_END in text else None)


@dataclass
class Job:
    """One source row being regenerated: prompt turns kept, assistant turns written in order."""
    g: int                         # row ordinal over all sources
    file: int
    row: int
    source: dict                   # the row as read (tools and other fields are kept)
    todo: list[list[dict]]         # per turn to write: the source messages up to it (exclusive)
    tail: list[dict]               # messages after the last written turn
    done: list[dict] = field(default_factory=list)   # the conversation so far, regenerated turns in
    reasons: list[str] = field(default_factory=list)
    tokens: int = 0
    error: tuple[str, str] | None = None  # why the row cannot be regenerated (it is skipped)

    @classmethod
    def of(cls, g, fi, ri, row, msgs, turns: str) -> "Job":
        asst = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if turns == "first":  # the first exchange only: what a user asks first, answered by the target
            users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
            first_user = users[0] if users else None
            if first_user is None or (asst and asst[0] < first_user):
                job = cls(g, fi, ri, row, [], [])
                job.error = ("no_prompt", "no user message before the first assistant turn")
                return job
            return cls(g, fi, ri, row, [msgs[:first_user + 1]], [])
        if not asst:  # a prompt-only row: the answer is appended; --turns all: one after each user turn
            if turns == "all":  # MT-Bench: the second question follows the target's own first answer
                users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
                return cls(g, fi, ri, row, [msgs[(users[k - 1] + 1 if k else 0):i + 1]
                                            for k, i in enumerate(users)], msgs[users[-1] + 1:] if users else [])
            return cls(g, fi, ri, row, [msgs], [])
        if turns == "last":
            return cls(g, fi, ri, row, [msgs[:asst[-1]]], msgs[asst[-1] + 1:])
        cuts = [msgs[(asst[k - 1] + 1 if k else 0):i] for k, i in enumerate(asst)]
        return cls(g, fi, ri, row, cuts, msgs[asst[-1] + 1:])

    def pending(self) -> bool:
        return self.error is None and len(self.reasons) < len(self.todo)

    def prompt(self) -> list[dict]:
        return self.done + self.todo[len(self.reasons)]

    def accept(self, r: Reply):
        if r.error is not None:
            self.error = r.error
            return
        self.done = self.prompt() + [{"role": "assistant", "content": r.text,
                                      **({"reasoning_content": r.reasoning} if r.reasoning is not None else {}),
                                      **({"tool_calls": r.tool_calls} if r.tool_calls else {})}]
        self.reasons.append(r.finish_reason)
        self.tokens += r.tokens


def read_jobs(cfg: RegenConfig) -> tuple[list[dict], list[Job], Counter, dict]:
    """Every row of DATA as a job, in source order; bad rows counted by reason and named."""
    sources = describe(resolve(cfg.data))
    jobs, skipped, examples = [], Counter(), {}
    files = [Path(s["path"]) for s in sources]
    for g, (fi, ri, where, row) in enumerate(iter_rows(files)):
        if cfg.max_rows and g >= cfg.max_rows:
            break
        try:
            if isinstance(row, RowError):
                raise row
            if not isinstance(row, dict):
                raise RowError("bad_field", where, f"row is a {type(row).__name__}, not an object")
            msgs = normalize_chat(row, where, require_assistant=False)
            if msgs is None:
                raise RowError("bad_field", where, "a plain 'text' row has no prompt to answer")
            jobs.append(Job.of(g, fi, ri, row, msgs, cfg.turns))
        except RowError as e:
            skipped[e.reason] += 1
            examples.setdefault(e.reason, str(e))
    if not jobs:
        raise DataError(f"DATA {cfg.data}: no usable rows ({dict(skipped)})")
    return sources, jobs, skipped, examples
