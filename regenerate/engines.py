"""Who writes the turns: the target on its device (LocalEngine) or a running OpenAI-compatible
server (OpenAIEngine: vLLM, SGLang). Both answer a batch of chats with Replies."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from regenerate.config import RegenConfig, RegenError
from regenerate.jobs import Reply
from shared.data import Encoder, RowError


class LocalEngine:
    """The target on its device, batched by prompt length. Greedy turns of a dense target decode
    with a static cache and a captured step (regenerate/decode.py); sampling and the hybrid
    (DeltaNet + attention) family go through transformers' generate and the cache it builds."""

    def __init__(self, cfg: RegenConfig, device: str, model=None, tokenizer=None):
        import torch

        from shared.target import compute_dtype, end_of_turn, load_target, load_tokenizer
        self.torch, self.cfg = torch, cfg
        self.device = torch.device(device)
        dtype = compute_dtype(cfg.dtype, self.device)
        # benchmarks pass a model built in memory; otherwise loaded from cfg.target
        self.model = model if model is not None else load_target(cfg.target, self.device, dtype)
        self.tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.target)
        self.enc = Encoder(self.tok, cfg.max_prompt_len, "skip", cfg.chat_template_kwargs)
        self.eot = end_of_turn(self.tok)[1]
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eot
        from regenerate.decode import StaticGreedy, supports_static
        applies = cfg.temperature == 0 and supports_static(self.model)
        if cfg.decoder == "static" and not applies:
            raise RegenError("--decoder static decodes greedy turns (--temperature 0) of dense targets only")
        static = applies and cfg.decoder in ("static", "auto")
        self.static = StaticGreedy(self.model, cfg.batch_size) if static else None

    def generate(self, prompts: list[tuple[list[dict], list | None]], seed: int) -> list[Reply]:
        out: list[Reply | None] = [None] * len(prompts)
        ids, where = [], []
        for i, (m, t) in enumerate(prompts):
            try:
                x = self.tok(self.enc.prompt(m, t), add_special_tokens=False)["input_ids"]
            except RowError as e:
                out[i] = Reply("", "error", 0, error=(e.reason, str(e)))
                continue
            if len(x) > self.cfg.max_prompt_len:
                out[i] = Reply("", "error", 0, error=("too_long", f"prompt of {len(x)} tokens > --max-prompt-len "
                                                                  f"{self.cfg.max_prompt_len}"))
                continue
            ids.append(x)
            where.append(i)
        for i, (new, stop) in zip(where, self.generate_ids(ids, seed) if ids else []):
            out[i] = Reply.of_text(self.tok.decode(new, skip_special_tokens=False), "stop" if stop else "length",
                                   len(new) + stop)
        return out  # type: ignore[return-value]

    def generate_ids(self, ids: list[list[int]], seed: int) -> list[tuple[list[int], bool]]:
        """(new tokens before the end of turn, whether it stopped) per prompt, in prompt order."""
        torch = self.torch
        order = sorted(range(len(ids)), key=lambda i: (-len(ids[i]), i))
        out: list[tuple[list[int], bool] | None] = [None] * len(ids)
        for b, lo in enumerate(range(0, len(order), self.cfg.batch_size)):
            batch = order[lo:lo + self.cfg.batch_size]
            if self.static is not None:
                for i, r in zip(batch, self.static.run([ids[i] for i in batch], self.cfg.max_new_tokens, self.eot,
                                                       self.pad)):
                    out[i] = r
                continue
            S = max(len(ids[i]) for i in batch)
            x = torch.full((len(batch), S), self.pad, dtype=torch.long)
            att = torch.zeros((len(batch), S), dtype=torch.long)
            for r, i in enumerate(batch):  # left padding: every prompt ends where generation starts
                x[r, S - len(ids[i]):] = torch.tensor(ids[i])
                att[r, S - len(ids[i]):] = 1
            sample = self.cfg.temperature > 0
            if sample:
                torch.manual_seed(seed * 1_000_003 + b)
            kw = dict(do_sample=True, temperature=self.cfg.temperature, top_p=self.cfg.top_p) if sample else \
                dict(do_sample=False)
            with torch.no_grad():
                gen = self.model.generate(input_ids=x.to(self.device), attention_mask=att.to(self.device),
                                          max_new_tokens=self.cfg.max_new_tokens, eos_token_id=self.eot,
                                          pad_token_id=self.pad, **kw)
            for r, i in enumerate(batch):
                new = gen[r, S:].tolist()
                stop = self.eot in new
                out[i] = (new[:new.index(self.eot)] if stop else new, stop)
        return out  # type: ignore[return-value]


class OpenAIEngine:
    """A running OpenAI-compatible server (vllm serve, SGLang): /chat/completions with bounded
    concurrency and retries with exponential backoff on connection errors, 429 and 5xx."""

    def __init__(self, cfg: RegenConfig):
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self.model = cfg.model or (Path(cfg.target).name if cfg.target else "default")
        key = os.environ.get(cfg.api_key_env)
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.pool = ThreadPoolExecutor(cfg.concurrency)

    def _one(self, messages, tools, seed: int) -> Reply:
        body = {"model": self.model, "messages": messages, "max_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "seed": seed}
        if tools:
            body["tools"] = tools
        if self.cfg.chat_template_kwargs:  # vLLM and SGLang pass it to the chat template
            body["chat_template_kwargs"] = self.cfg.chat_template_kwargs
        data = json.dumps(body).encode()
        err = None
        for attempt in range(self.cfg.retries):
            try:
                req = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.cfg.request_timeout) as resp:
                    ans = json.loads(resp.read())
                choice = ans["choices"][0]
                msg = choice.get("message") or {}
                reason = "length" if choice.get("finish_reason") == "length" else "stop"
                tokens = (ans.get("usage") or {}).get("completion_tokens", 0)
                # a server with a reasoning parser returns the thinking apart (reasoning_content, or
                # reasoning in newer vLLM): kept, or the turn would be trained without it
                reasoning = next((msg[k] for k in ("reasoning_content", "reasoning") if isinstance(msg.get(k), str)),
                                 None)
                return Reply(msg.get("content") or "", reason, int(tokens), msg.get("tool_calls") or None,
                             reasoning=reasoning)
            except urllib.error.HTTPError as e:
                err = f"HTTP {e.code}: {e.read()[:200]!r}"
                if e.code != 429 and e.code < 500:  # this row refused (too long, bad tools): retrying changes nothing
                    return Reply("", "error", 0, error=("server_refused", f"{self.url}: {err}"))
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError, KeyError) as e:
                err = f"{type(e).__name__}: {e}"
            time.sleep(min(30.0, 0.2 * 2 ** attempt))
        raise RegenError(f"{self.url}: request failed after {self.cfg.retries} attempt(s): {err}")

    def generate(self, prompts, seed: int) -> list[Reply]:
        return list(self.pool.map(lambda p: self._one(p[1][0], p[1][1], seed + p[0]), enumerate(prompts)))
