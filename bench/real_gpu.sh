#!/usr/bin/env bash
# A real target on one GPU (issue 25): SmolLM2-135M-Instruct (GGUF) answers ShareGPT's first turns,
# stores of dataset and regenerated answers are extracted, drafters are trained from them and
# evaluated on MT-Bench and HumanEval beside prompt lookup. Run by the device tool in three
# consecutive calls (files outside the tree stay while the machine is warm):
#   bash bench/real_gpu.sh prep    carry .whl, .gg/smol.part00: wheels into /tmp/site, part 00 to /tmp/gg
#   bash bench/real_gpu.sh data    carry .gg/smol.part01, .gg/smol.part02, .gg/sharegpt-first.jsonl.gz:
#                                  decoder benchmark, regeneration, extraction of dataset and
#                                  regenerated answers; trainings start in the background (setsid)
#                                  as their stores are written
#   bash bench/real_gpu.sh eval    waits for the trainings, evaluates every drafter; results under $OUT
#   bash bench/real_gpu.sh all     data and eval in one call (a short lease), smaller sizes
#   bash bench/real_gpu.sh decode  the decoder benchmark and the regeneration alone
# .gg/sharegpt-first.jsonl.gz: the first (human, gpt) pair of ShareGPT's first 6,000 records that
# begin with one (`python -m shared.named_data sharegpt`, read by our reader).
#   ROWS, STEPS, PROMPTS, MAX_NEW, REGEN_BATCH: the run's size; EVAL_S: seconds per evaluation.
# Call it without `| tail`: a call cut off by its time limit then still returns what was printed
# (the device tool keeps the last 12,000 characters); every step's log is also under /tmp/log.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_TARGET_CACHE=/tmp/targets HF_HUB_OFFLINE=1
ROWS=${ROWS:-4000}; STEPS=${STEPS:-1000}; PROMPTS=${PROMPTS:-10}; MAX_NEW=${MAX_NEW:-128}
REGEN_BATCH=${REGEN_BATCH:-512}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gg /tmp/s /tmp/r /tmp/d /tmp/log
T=/tmp/gg/SmolLM2-135M-Instruct.Q4_1.gguf
DATA=.gg/sharegpt-first.jsonl.gz
stamp() { echo "[$(date +%T)] $*"; }

train_bg() {  # name store [train options...]: a background training that outlives this call
    local name=$1 store=$2; shift 2
    setsid nohup bash -c "python3 -m train --store $store --out /tmp/r/$name --gpus 0 --mask-token-id 0 \
        --seq-len 4096 --max-anchors 256 --max-steps $STEPS --lr 3e-3 --log-every 100 --eval-every 250 \
        --eval-samples 64 --workers 2 --no-progress $* > /tmp/log/train-$name.log 2>&1; \
        echo \$? > /tmp/r/$name.rc" > /dev/null 2>&1 &
}

case "${1:-}" in
prep)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    cp .gg/smol.part00 /tmp/gg/
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    # the static decoder's captured step against generate on the GPU (tiny models, fp32)
    python3 -m pytest -q -p no:cacheprovider tests/test_regenerate_decode.py 2>&1 | tail -3
    ;;
data)
    [ -f $T ] || cat /tmp/gg/smol.part00 .gg/smol.part01 .gg/smol.part02 > $T
    md5sum $T   # a1231443440b107ff29f02bdb38c9d0a
    stamp "decoder benchmark"
    timeout ${BENCH_S:-200} python3 bench/regen_bench.py --target $T --data $DATA --max-new 512 --max-prompt-len 1024 \
        --decoders ${DECODERS:-generate:256:256,static:512:2048,static:1024:2048} --json $OUT/regen_bench.json 2>&1 \
        | grep --line-buffered -v -i "warn\|it/s"
    # Six target layers: DFlash's defaults for 5 draft layers (1,8,14,20,27), 3 (1,14,27) and 1 (15).
    ext() {  # name data [extract options...]
        local name=$1 data=$2; shift 2
        python3 -m extract --data $data --max-rows $ROWS --target $T --store /tmp/s/$name --gpus 0 --max-len 2048 \
            --layers 1,8,14,15,20,27 --no-progress "$@" > /tmp/log/extract-$name.log 2>&1
        stamp "extracted $name: rc $?"; tail -n 2 /tmp/log/extract-$name.log
    }
    stamp "regenerate $ROWS first turns (greedy, batch $REGEN_BATCH), beside the dataset answers' extraction"
    ext data $DATA &
    timeout ${REGEN_S:-200} python3 -m regenerate --data $DATA --max-rows $ROWS --target $T --out /tmp/d/regen --gpus 0 \
        --batch-size $REGEN_BATCH --max-new-tokens 512 --max-prompt-len 2048 --no-progress > /tmp/log/regen.log 2>&1
    stamp "regenerated: rc $?"; tail -n 3 /tmp/log/regen.log
    cp /tmp/d/regen/part-00000.jsonl $OUT/regen-part-00000.jsonl 2>/dev/null
    wait
    [ -n "${DECODE_ONLY:-}" ] && exit 0
    train_bg data-3 /tmp/s/data --draft-layers 3 --labels data
    train_bg data-3-argmax /tmp/s/data --draft-layers 3 --labels argmax
    ext regen /tmp/d/regen &
    ext regen-fp8 /tmp/d/regen --precision fp8 &
    wait
    for n in 1 3 5; do train_bg regen-$n /tmp/s/regen --draft-layers $n --labels data; done
    train_bg regen-3-fp8 /tmp/s/regen-fp8 --draft-layers 3 --labels data
    du -sh /tmp/s/*
    stamp "trainings started"
    ;;
eval)
    RUNS=${RUNS:-data-3 data-3-argmax regen-1 regen-3 regen-5 regen-3-fp8}
    # the store codecs on the real features, on this host (issue 26), while the trainings finish
    [ -d /tmp/s/regen ] && python3 bench/codec_bench.py /tmp/s/regen > $OUT/codec-h100.txt 2>&1 &
    for name in $RUNS; do
        for _ in $(seq 60); do [ -f /tmp/r/$name.rc ] && break; sleep 5; done
        [ -f /tmp/r/$name.rc ] || { tail -n 5 /tmp/log/train-$name.log; continue; }
        stamp "$name trained: rc $(cat /tmp/r/$name.rc)"; tail -2 /tmp/log/train-$name.log
        cp /tmp/r/$name/metrics.jsonl $OUT/metrics-$name.jsonl
        timeout ${EVAL_S:-300} python3 -m eval.speculative --drafter /tmp/r/$name/export --target $T \
            --prompt-set mt-bench --prompt-set humaneval --prompts $PROMPTS --max-new $MAX_NEW --no-progress \
            --json $OUT/eval-$name.json > /tmp/log/eval-$name.log 2>&1 &
    done
    wait
    tail -n 6 /tmp/log/eval-*.log
    cat $OUT/codec-h100.txt 2>/dev/null
    du -s --block-size=1 /tmp/s/* > $OUT/store-sizes.txt
    ;;
decode)  # the decoder benchmark and the regeneration only (a short lease)
    ROWS=${ROWS:-2000} BENCH_S=${BENCH_S:-130} REGEN_S=${REGEN_S:-100} \
        DECODERS=${DECODERS:-generate:256:256,static:512:2048} DECODE_ONLY=1 bash "$0" data
    ;;
all)  # data, then eval, in one call of at most ALL_S (570) s, a short lease: smaller sizes, hard limits
    start=$(date +%s)
    ROWS=3000 STEPS=600 PROMPTS=12 BENCH_S=130 REGEN_S=120 DECODERS=generate:256:256,static:512:2048 \
        bash "$0" data
    left=$((${ALL_S:-570} - ($(date +%s) - start)))
    stamp "eval with ${left}s left"
    PROMPTS=12 timeout $((left > 30 ? left - 10 : 20)) bash "$0" eval
    ;;
*)
    echo "usage: bash bench/real_gpu.sh prep|data|eval"; exit 2 ;;
esac
