"""Prompt lookup (n-gram) drafting: the baseline a trained drafter is compared with, needing no
training at all (vLLM's `ngram` speculative method, transformers' prompt_lookup_num_tokens).

The longest suffix of the committed tokens (max_ngram down to min_ngram tokens) is looked up in
the tokens before it, most recent occurrence first, and the up to k tokens that followed it
there are proposed. No match: nothing is proposed and the verification commits one token, as
plain decoding does.
"""

from __future__ import annotations


def lookup(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' longest suffix n-gram."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # every earlier occurrence, latest first (may overlap it)
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def prompt_lookup_proposal(k: int, max_ngram: int = 3, min_ngram: int = 1):
    """propose(tokens, ctx) for eval.speculative.speculative: ctx (target features) is unused."""
    def propose(tokens: list[int], ctx) -> list[int]:
        return lookup(tokens, k, max_ngram, min_ngram)
    return propose
