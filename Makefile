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
PYTEST_ARGS  ?=

.PHONY: venv test extract train inspect verify tiny demo clean

$(BIN)/.ready: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.ready

# The built-in tiny Qwen3.5-style hybrid target, its tokenizer and the default chat corpus.
tiny: venv
	$(BIN)/python -m shared.tiny --out build

build/tiny-target/config.json build/corpus/chat.jsonl:
	$(MAKE) tiny

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

extract: venv $(if $(filter build/%,$(TARGET) $(DATA)),build/tiny-target/config.json)
	$(BIN)/python -m extract --data "$(DATA)" --target "$(TARGET)" --store "$(STORE)" --gpus "$(GPUS)" $(EXTRACT_ARGS)

inspect: venv
	$(BIN)/python -m extract.inspect "$(STORE)"

verify: venv
	$(BIN)/python -m extract.inspect "$(STORE)" --verify

train: venv
	$(BIN)/python -m train --store "$(STORE)" --out "$(OUT)" --gpus "$(GPUS)" $(if $(DRAFT),--draft "$(DRAFT)") $(TRAIN_ARGS)

demo: venv build/tiny-target/config.json
	$(BIN)/python -m extract --data "$(DATA)" --target "$(TARGET)" --store "$(STORE)" --gpus "$(GPUS)" $(EXTRACT_ARGS)
	$(BIN)/python -m extract.inspect "$(STORE)" --verify
	$(BIN)/python -m train --store "$(STORE)" --out "$(OUT)" --gpus "$(GPUS)" $(TRAIN_ARGS)

clean:
	rm -rf build stores runs
