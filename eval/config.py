"""The evaluation stage's options: `python -m eval.speculative --help`, `python -m eval.ablate --help`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.cli import opt, parse_json_object

TEMPLATE_HELP = ("JSON object for the chat template, as at extraction and serving (e.g. "
                 "'{\"enable_thinking\": false}'); see `make inspect` for the store's")


@dataclass
class SpecConfig:
    target: str = opt(help="the target checkpoint")
    drafter: list[str] = opt(help="exported drafter folder (config.json + model.safetensors); repeatable: several "
                                  "drafters of one target share the greedy and prompt-lookup decodings",
                             repeat=True, default_factory=list)
    data: str | None = opt(None, "chat rows; the prompt of each of the last --prompts rows' last assistant turn")
    prompt_set: list[str] = opt(help="mt-bench, humaneval (installed from the package registry: shared/named_data.py) "
                                     "or a DATA file: each row's user turns asked in order after the target's own "
                                     "answers (repeatable; the first --prompts rows)", repeat=True, default_factory=list)
    prompts: int = opt(16, "rows decoded per set (0: all)")
    prompt_lookup: bool = opt(True, "also decode with prompt lookup (n-gram) drafting: the baseline, same prompts")
    max_new: int = opt(64, "new tokens per prompt")
    max_prompt: int = opt(512, "prompt tokens kept (the last ones)")
    device: str = opt("auto", "auto: the GPU if there is one, else cpu; or cuda:1, cpu")
    dtype: Literal["auto", "bf16", "fp32"] = opt("auto", "auto: bf16 on GPU, fp32 on CPU")
    chat_template_kwargs: dict = opt(help=TEMPLATE_HELP, parse=parse_json_object, default_factory=dict)
    json: str | None = opt(None, "write the summary to this JSON file")
    allow_other_target: bool = opt(False, "evaluate although the drafter records another target's embed/lm_head")
    progress: bool = opt(True, "tqdm progress bar")

    def __post_init__(self):
        if isinstance(self.drafter, str):  # one drafter, as a program passes it
            self.drafter = [self.drafter]


@dataclass
class AblateConfig:
    store: str = opt(help="the store every run trains from")
    out: str = opt(help="folder of the runs (OUT/<name>/), the table and the plot")
    grid: list[str] = opt(help="NAME=V1,V2 (repeatable; default draft_layers=1,2,3): a python -m train option "
                               "and its values", repeat=True, default_factory=list)
    target: str | None = opt(None, "decode every export for real with this target (and --data)")
    data: str | None = opt(None, "chat rows whose last --prompts are the decoding prompts")
    prompts: int = opt(8, "prompts decoded per export")
    max_new: int = opt(48, "new tokens per prompt")
    chat_template_kwargs: dict = opt(help=TEMPLATE_HELP, parse=parse_json_object, default_factory=dict)
