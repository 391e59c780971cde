"""What a target family provides, in one place: the seam a new family is added at.

A family says which `model_type`s it covers, where its decoder config and its decoder layers are,
and whether its linear-attention layers run through flash-linear-attention. Everything else a
stage needs is the same for every HF causal LM here: `model.model` is the decoder whose layer i's
output is layer id i (HF `hidden_states[i+1]`), `model.lm_head` the head, `embed_tokens` and
`lm_head` tensors in the safetensors (tied embeddings: `lm_head` is `embed_tokens`), and the end
of an assistant turn is ChatML's `<|im_end|>` where the vocabulary has it, else the eos token
(shared/target.py).

Not here on purpose: families whose embedding is scaled inside the model (Gemma multiplies by
sqrt(hidden)): the drafter embeds its block with the target's `embed_tokens` as the engines do, and
a family of that kind needs its scale in the drafter and in the engines' DFlash path first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    nested_text_config: bool = False  # config.json holds the decoder under text_config (a multimodal wrapper)
    fla: bool = False                 # Gated DeltaNet layers: FLA's kernels on a GPU, torch's on the CPU
    norm_offset: float = 0.0          # RMSNorm scales stored as offsets from 1 (the norm multiplies by 1 + w)
    gated_query: bool = False         # q_proj also emits an output gate: per head, head_dim query rows then head_dim gate rows

    def text_config(self, cfg: dict) -> dict:
        """The decoder's config (num_hidden_layers, hidden_size, vocab_size, ...)."""
        return cfg.get("text_config", cfg) if self.nested_text_config else cfg

    def decoder_layers(self, model):
        inner = model.model
        return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


FAMILIES = (
    # Qwen3.5 / Qwen3.6: Gated DeltaNet + gated full attention, the multimodal wrapper or its text model
    Family("qwen3.5", ("qwen3_5", "qwen3_5_text"), nested_text_config=True, fla=True, norm_offset=1.0,
           gated_query=True),
    # dense decoders: RoPE attention (full or sliding) + MLP, embeddings unscaled
    Family("dense", ("llama", "mistral", "qwen2", "qwen3")),
)


def family_of(model_type: str | None) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def supported_model_types() -> list[str]:
    return [t for f in FAMILIES for t in f.model_types]
