#!/usr/bin/env bash
# A real target on one GPU (issue 25): SmolLM2-135M-Instruct (GGUF) extracted over ShareGPT's
# first 2,000 records (dataset answers), a drafter trained from the store, evaluated on MT-Bench
# and HumanEval beside prompt lookup. Run by the device tool with the GGUF in parts (it is larger
# than one call carries): part 00 was copied to /tmp/gg by the call before, parts 01-02 and the
# ShareGPT slice (.gg/sharegpt-2000.jsonl: our reader's first 2,000 complete records) travel here.
#   STEPS, PROMPTS, MAX_NEW, LAYERS: the run's size.
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_TARGET_CACHE=/tmp/targets HF_HUB_OFFLINE=1
STEPS=${STEPS:-1500}; PROMPTS=${PROMPTS:-30}; MAX_NEW=${MAX_NEW:-128}; LAYERS=${LAYERS:-3}
T=/tmp/gg/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $T ] || cat /tmp/gg/smol.part00 .gg/smol.part01 .gg/smol.part02 > $T
md5sum $T   # a1231443440b107ff29f02bdb38c9d0a
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
python3 -m extract --data .gg/sharegpt-2000.jsonl --target $T --store /tmp/s/real --gpus 0 --max-len 2048 \
    --draft-layers $LAYERS --no-progress
t1=$(date +%s)
python3 -m train --store /tmp/s/real --out /tmp/r/real --gpus 0 --draft-layers $LAYERS --mask-token-id 0 \
    --seq-len 4096 --max-anchors 256 --labels argmax --max-steps $STEPS --lr 3e-3 --log-every 100 \
    --eval-every 500 --eval-samples 64 --no-progress
t2=$(date +%s)
python3 -m eval.speculative --drafter /tmp/r/real/export --target $T --prompt-set mt-bench \
    --prompt-set humaneval --prompts $PROMPTS --max-new $MAX_NEW --no-progress --json "${OUT:-/tmp}/eval.json"
t3=$(date +%s)
cp /tmp/r/real/metrics.jsonl "${OUT:-/tmp}/" || true
echo "seconds: extract $((t1 - t0)) train $((t2 - t1)) eval $((t3 - t2))"
