"""The regeneration stage's options (`python -m regenerate --help`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.cli import opt, parse_gpus, parse_json_object


class RegenError(RuntimeError):
    pass


@dataclass
class RegenConfig:
    data: str = opt(help="rows whose prompts are kept (every format `make extract` reads)")
    out: str = opt(help="output DATA folder (sharded jsonl); rerun the same command to resume")
    target: str | None = opt(None, "local HF checkpoint that writes the answers (engine local), recorded "
                                   "in the provenance")
    engine: Literal["local", "openai"] = opt("local", "local: transformers generate on the target's device; "
                                                      "openai: a running OpenAI-compatible server (vLLM, SGLang)")
    gpus: list[int] = opt(help="e.g. 0,1: one worker per GPU; empty: CPU", parse=parse_gpus, default_factory=list)
    base_url: str | None = opt(None, "openai engine: the server, e.g. http://127.0.0.1:8000/v1")
    model: str | None = opt(None, "openai engine: the served model name (default: the target folder's name)")
    api_key_env: str = opt("OPENAI_API_KEY", "openai engine: environment variable holding the API key, if any")
    concurrency: int = opt(16, "openai engine: requests in flight")
    retries: int = opt(5, "openai engine: attempts per request on errors, 429 and 5xx (exponential backoff)")
    request_timeout: float = opt(600.0, "openai engine: seconds per request")
    max_rows: int = opt(0, "regenerate only DATA's first N rows (0: all), e.g. a slice of ShareGPT")
    turns: Literal["last", "all", "first"] = opt(
        "last", "regenerate the last assistant turn; every one in order (each conditioned on the regenerated "
        "earlier ones); or the first exchange only (the first user message answered, the rest of the row dropped)")
    max_new_tokens: int = opt(512, "tokens per generated turn; a turn that hits it is kept, its finish "
                                   "reason 'length' recorded")
    temperature: float = opt(0.0, "0: greedy")
    top_p: float = opt(1.0, "nucleus sampling when temperature > 0")
    seed: int = opt(0, "sampling seed (per shard and batch locally, per row for the openai engine)")
    chat_template_kwargs: dict = opt(help="JSON object for the chat template, as serving passes it, e.g. "
                                          "'{\"enable_thinking\": false}'", parse=parse_json_object,
                                     default_factory=dict)
    drop_length: bool = opt(False, "drop rows whose generation hit --max-new-tokens instead of keeping them")
    decoder: Literal["auto", "static", "generate"] = opt(
        "auto", "local engine: static = our static-cache greedy decoder, its step a CUDA graph on a GPU "
                "(dense targets, temperature 0); generate = transformers' generate; auto = static where it applies")
    batch_size: int = opt(32, "local engine: prompts per generate call (batched by prompt length)")
    max_prompt_len: int = opt(4096, "prompts longer than this (tokens) are skipped as too_long")
    shard_rows: int = opt(256, "source rows per output shard (the unit of resume)")
    dtype: Literal["auto", "bf16", "fp32"] = opt("auto", "local engine: auto = bf16 on GPU, fp32 on CPU")
    progress: bool = opt(True, "tqdm progress bar")

    def validate(self):
        if self.engine == "local" and not self.target:
            raise RegenError("--engine local needs --target")
        if self.engine == "openai" and not self.base_url:
            raise RegenError("--engine openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise RegenError("--temperature must be >= 0 and --top-p in (0, 1]")
        for name in ("max_new_tokens", "batch_size", "shard_rows", "concurrency", "retries"):
            if getattr(self, name) < 1:
                raise RegenError(f"--{name.replace('_', '-')} must be at least 1")
        return self

    def generation(self) -> dict:
        """The settings that decide what is generated: a resumed run must repeat them."""
        keys = ("engine", "model", "turns", "max_new_tokens", "temperature", "top_p", "seed",
                "chat_template_kwargs", "drop_length", "max_prompt_len", "shard_rows", "batch_size", "dtype",
                "decoder")
        # max_rows only when set: an OUT written before the option resumes
        return {k: getattr(self, k) for k in keys} | ({"max_rows": self.max_rows} if self.max_rows else {})
