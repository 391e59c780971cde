"""Chats -> training samples in which every assistant turn is trained as serving shows it.

The rule (docs/DESIGN.md, "Chat turns"): every loss token is a token the target emits at serving
time, after exactly the context serving gives it, in the chosen template options. For assistant
turn k the context is the template's render of the messages before it with the generation prompt,
tokenized as one string (as an engine tokenizes a chat request); the output is what the model
writes there: the template's render of the conversation ending with turn k, past that prompt,
through the end-of-turn token (reasoning in the template's form, content, tool-call text).

Several turns share one sample when the serving tokens of each are a prefix of the sample's
tokens. Templates that rewrite history (Qwen3/3.5/3.6 drop the reasoning of turns before the last
user query) make that impossible for the earlier turns: they are split into samples of their own
(`inexact="split"`, the default) or kept in the row's sample as context without loss
(`inexact="context"`). Nothing searches the render for a turn's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.target import end_of_turn

THINK_START, THINK_END = "<think>", "</think>"
INEXACT = ("split", "context")


class ChatError(ValueError):
    """A chat that cannot be trained as served; `reason` is the count's key in the report."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, answer) of a content that holds its reasoning inline, by the rule the Qwen3
    templates apply to history: the reasoning is what precedes the first </think> (after the last
    <think> before it), the answer what follows the last </think>, newlines trimmed at the seams.
    ("", content) when there is no </think>."""
    if THINK_END not in content:
        return "", content
    head = content[:content.index(THINK_END)].rstrip("\n")
    if THINK_START in head:
        head = head[head.rindex(THINK_START) + len(THINK_START):]
    return head.lstrip("\n"), content[content.rindex(THINK_END) + len(THINK_END):].lstrip("\n")


def reasoning_of(msg: dict) -> str:
    """An assistant message's reasoning: its reasoning_content field, else inline <think> text."""
    r = msg.get("reasoning_content")
    return r if isinstance(r, str) else split_reasoning(msg.get("content") or "")[0]


def strip_reasoning(msg: dict) -> dict:
    """The message without its reasoning (field and inline block): what a non-thinking turn holds."""
    out = {k: v for k, v in msg.items() if k != "reasoning_content"}
    if THINK_END in out.get("content", ""):
        out["content"] = split_reasoning(out["content"])[1]
    return out


@dataclass
class Turn:
    """One trained assistant turn as serving sees it."""
    index: int          # position in the messages
    prompt: list[int]   # the serving context, tokenized as one string
    output: list[int]   # what the model writes there, through the end of turn


@dataclass
class Sample:
    """Token ids and the [start, end) runs that carry loss, one run per trained turn."""
    ids: list[int]
    runs: list[tuple[int, int]]


@dataclass
class ChatSamples:
    samples: list[Sample]
    turns: int                 # trained turns (loss runs over all samples)
    split: int = 0             # trained in a sample of their own context (not the row's last)
    context: int = 0           # kept as context only (inexact="context")
    split_tokens: int = 0      # tokens of the samples before the row's own (last): the cost of splitting


class ChatRenderer:
    """Renders chats for one tokenizer with the chat template options serving uses
    (`template_kwargs`, e.g. {"enable_thinking": False})."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None,
                 inexact: Literal["split", "context"] = "split", drop_reasoning: bool = False):
        if inexact not in INEXACT:
            raise ValueError(f"inexact turns must be one of {INEXACT}, not {inexact!r}")
        self.tok = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.inexact, self.drop_reasoning = inexact, drop_reasoning
        self.eot = end_of_turn(tokenizer)[0]
        self._thinking_off: bool | None = None

    def apply(self, msgs: list[dict], tools=None, generation: bool = False) -> str:
        try:
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation,
                                                **({"tools": tools} if tools else {}), **self.template_kwargs)
        except Exception as e:  # a template that rejects the conversation (role order, no user query)
            raise ChatError("template_error", f"chat template failed: {e}") from None

    def prompt(self, msgs: list[dict], tools=None) -> str:
        """The text the target sees before it writes the next assistant turn."""
        return self.apply(msgs, tools, generation=True)

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    @property
    def thinking_off(self) -> bool:
        """Whether serving runs with thinking off: the options say so, or the template's generation
        prompt closes an (empty) think block itself."""
        if self._thinking_off is None:
            off = self.template_kwargs.get("enable_thinking") is False
            if not off:
                probe = [{"role": "user", "content": "x"}]
                try:
                    off = THINK_END in self.prompt(probe)[len(self.apply(probe)):]
                except ChatError:
                    off = False
            self._thinking_off = off
        return self._thinking_off

    def _messages(self, msgs: list[dict]) -> list[dict]:
        """The messages as the template will see them: reasoning dropped on request, refused when
        thinking is off (a drafter would learn reasoning the target never writes there)."""
        if self.drop_reasoning:
            return [strip_reasoning(m) if m["role"] == "assistant" else m for m in msgs]
        if self.thinking_off:
            for i, m in enumerate(msgs):
                if m["role"] == "assistant" and reasoning_of(m).strip():
                    raise ChatError("thinking_mismatch",
                                    f"messages[{i}] carries reasoning but the chat template options turn thinking "
                                    f"off ({self.template_kwargs or 'the template default'}): serving never shows "
                                    f"it; --strip-reasoning trains the answers without it")
        return msgs

    def turn(self, msgs: list[dict], i: int, tools=None) -> Turn | None:
        """Assistant turn i as serving sees it; None when there is nothing to train: an empty turn,
        or one that answers no user message (serving never writes it)."""
        m = msgs[i]
        if not (m["content"].strip() or m.get("tool_calls") or reasoning_of(m).strip()) \
                or not any(x["role"] == "user" for x in msgs[:i]):
            return None
        before = self.prompt(msgs[:i], tools)
        upto = self.apply(msgs[:i + 1], tools)
        if not upto.startswith(before):
            common = next((j for j, (a, b) in enumerate(zip(before, upto)) if a != b), min(len(before), len(upto)))
            raise ChatError("template_error",
                            f"messages[{i}]: the template renders this turn without the generation prompt before "
                            f"it (prompt has {before[common:common + 40]!r} where the turn has "
                            f"{upto[common:common + 40]!r}), so what the model writes there is unknown")
        out = upto[len(before):]
        cut = out.rfind(self.eot) if self.eot else -1
        out = out[:cut + len(self.eot)] if cut >= 0 else out.rstrip()
        for call in m.get("tool_calls", ()):
            if call["function"]["name"] not in out:
                raise ChatError("template_error", f"messages[{i}]: the chat template does not render tool calls "
                                                  f"(it calls {call['function']['name']!r})")
        reasoning = reasoning_of(m).strip()
        if reasoning and reasoning not in out:
            raise ChatError("reasoning_not_rendered",
                            f"messages[{i}]: the chat template does not render this turn's reasoning "
                            f"(reasoning_content), so the target's output there is unknown")
        return Turn(i, self.ids(before), self.ids(out))

    def samples(self, msgs: list[dict], tools=None) -> ChatSamples:
        """The fewest samples that train every assistant turn exactly as served (or, with
        inexact="context", one sample that trains the turns it holds exactly)."""
        msgs = self._messages(msgs)
        turns = [t for i, m in enumerate(msgs) if m["role"] == "assistant"
                 and (t := self.turn(msgs, i, tools)) is not None]
        if not turns:
            return ChatSamples([], 0)
        out, left = [], turns
        while left:
            last = left[-1]
            seq = last.prompt + last.output
            held = [t for t in left if holds(seq, t)]
            out.append(Sample(seq, [(len(t.prompt), len(t.prompt) + len(t.output)) for t in held]))
            left = [t for t in left if all(t is not h for h in held)]
            if self.inexact == "context":
                break
        out.reverse()  # in the order of the turns; the row's own sample (its last turn) last
        rest = len(turns) - len(out[-1].runs)
        return ChatSamples(out, sum(len(s.runs) for s in out),
                           split=rest if self.inexact == "split" else 0,
                           context=rest if self.inexact == "context" else 0,
                           split_tokens=sum(len(s.ids) for s in out[:-1]))


def holds(seq: list[int], t: Turn) -> bool:
    """Whether seq begins with turn t's serving context followed by its output, token for token."""
    n, m = len(t.prompt), len(t.output)
    return len(seq) >= n + m and seq[:n] == t.prompt and seq[n:n + m] == t.output
