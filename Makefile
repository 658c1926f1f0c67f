# detinfer: `make run` and `make test` work on a fresh clone (they create .venv first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= Give me three tips for staying healthy.

.PHONY: run test test-boundscheck verify bench bench-busy bench-speculate bench-serve bench-lockstep profile bench-peers bench-models scale fuzz manifests golden-update install pull clean portability portability-full

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

pull: $(STAMP)
	$(BIN)/detinfer pull

THREADS ?=  # e.g. make run THREADS=1 for a fixed count (the default follows the free cores)
THREAD_OPT := $(if $(THREADS),--threads $(THREADS))

run: pull
	$(BIN)/detinfer run --chat --prompt "$(PROMPT)" --max-tokens 128 --out run.json $(THREAD_OPT)
	$(BIN)/detinfer run --manifest run.json --quiet $(THREAD_OPT)

test: pull
	$(BIN)/python -m pytest --durations=15

# The kernel-facing tests once more with numba's bounds checking on (its own JIT cache: numba's cache key ignores the
# flag): an index that validation missed becomes an IndexError instead of a silent out-of-bounds read. Bounds-checked
# kernels do not vectorize, so this pass is several times slower: it runs the tests that feed kernels, quant blocks,
# the sampler and KV files with real or malformed data (BOUNDSCHECK_TESTS), not the HTTP, framework or Ray tests,
# which reach the kernels only through the same paths.
BOUNDSCHECK_TESTS := tests/test_kernels.py tests/test_quants.py tests/test_arch.py tests/test_numerics.py tests/test_sampler.py \
	tests/test_kvcache.py tests/test_bad_input.py tests/test_fuzz.py tests/test_determinism.py
test-boundscheck: pull
	NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR=$(CURDIR)/.numba-boundscheck $(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow" $(BOUNDSCHECK_TESTS)

# The --threads 1 pass uses no derived file (GGUF index, tokenizer caches, repacked weights, numba's compiled kernels):
# everything from the GGUFs alone, so no damaged file under $DETINFER_HOME can make it agree.
verify: pull
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/detinfer verify --threads 1 --rederive
	$(BIN)/detinfer verify --threads 2

# Cross-machine proof (scripts/portability.py): committed manifests and goldens of both models re-executed bit for bit
# on the generic / haswell / skylake-avx512 / host compile targets, with the oldest numba/llvmlite/numpy pyproject.toml
# allows (second venv), and on aarch64 Linux under qemu-user (needs root for apt-get); plus a negative control (the
# fastmath build) that must be detected. A subset of the files (budget: 12 min on an idle 2-core machine); -full runs all.
portability: pull
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/python scripts/portability.py

portability-full: pull
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/python scripts/portability.py --full

manifests: pull
	$(BIN)/python scripts/golden.py manifests

golden-update: pull
	$(BIN)/python -m pytest -q tests/test_golden.py --snapshot-update

$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $@

# llama.cpp side by side: llama-cpp-python built once per instruction set, each into its own folder that the bench's
# llama.cpp worker for that ISA puts first on its import path (detinfer bench --peers-dir). Dependencies come from the
# venv except diskcache. pip's wheel cache is off because it keys a built wheel on the sdist alone: the second build
# would reuse the first one's binary. A folder is complete once its BUILD file (how it was built) exists; a killed
# build leaves only $(PEERS_DIR)/*.tmp, removed by the next run. Building from the sdist takes about 15 min per ISA
# on 2 cores; PEER_WHEELS=DIR installs DIR/host/ and DIR/avx2/ llama_cpp_python wheels built with the same CMAKE_ARGS.
# The native build's AMX path (ggml_backend_amx_mul_mat) segfaulted on this project's Xeon VM (llama.cpp issue 20824), so
# the host peer is built native with AMX compiled out (-mno-amx-*): every other extension of the host (AVX-512, VNNI,
# BF16) stays on. Should a peer still crash, the bench records it as not measured, with a warning, and keeps the rest.
LLAMA_CPP_VERSION := 0.3.36
PEERS_DIR := .bench
PEER_WHEELS ?=
CMAKE_ARGS_host := -DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16 \
	-DCMAKE_CXX_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16
CMAKE_ARGS_avx2 := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
	-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF \
	-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
PEER_MODE = $(if $(PEER_WHEELS),wheel,sdist)
PEER_WHEEL = $(wildcard $(PEER_WHEELS)/$*/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl)
PEER_PIP_sdist = --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_VERSION)
PEER_PIP_wheel = $(PEER_WHEEL)
PEER_HOW_sdist = built from the sdist with CMAKE_ARGS="$(CMAKE_ARGS_$*)"
PEER_HOW_wheel = installed from the prebuilt wheel $(PEER_WHEEL) (make PEER_WHEELS=...; to be built with CMAKE_ARGS="$(CMAKE_ARGS_$*)")

bench-peers: $(PEERS_DIR)/llama-cpp-host/BUILD $(PEERS_DIR)/llama-cpp-avx2/BUILD

$(PEERS_DIR)/llama-cpp-%/BUILD: | $(STAMP)
	@test -n "$(PEER_PIP_$(PEER_MODE))" || { echo "no llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl in $(PEER_WHEELS)/$*" >&2; exit 2; }
	rm -rf $(@D) $(@D).tmp
	CMAKE_ARGS="$(CMAKE_ARGS_$*)" $(BIN)/pip install --quiet --no-deps --no-cache-dir --target $(@D).tmp \
		$(PEER_PIP_$(PEER_MODE)) 'diskcache>=5.6.1'
	echo 'llama-cpp-python $(LLAMA_CPP_VERSION) $(PEER_HOW_$(PEER_MODE))' > $(@D).tmp/BUILD
	mv $(@D).tmp $(@D)

# The synthetic Llama-3.2-1B-shaped and Qwen3.5-0.8B-shaped (qwen35) models (bench/synth_model.py; about 3.4 GB,
# written once, checked by sha256).
BENCH_HOME := $(or $(DETINFER_HOME),$(HOME)/.cache/detinfer)/bench
LARGE_MODELS := $(BENCH_HOME)/synthetic-llama-1b-q4_k_m.gguf $(BENCH_HOME)/synthetic-llama-1b-q8_0.gguf \
	$(BENCH_HOME)/synthetic-qwen35-0.8b-q4_k_m.gguf $(BENCH_HOME)/synthetic-qwen35-0.8b-q8_0.gguf
bench-models: $(STAMP)
	$(BIN)/python bench/synth_model.py --dir $(BENCH_HOME)
	$(BIN)/python bench/synth_model.py --shape qwen35-0.8b --dir $(BENCH_HOME)

# Both models on both ISAs side by side with llama.cpp, the host-only figures, the 1B-class pass (two runs per figure,
# about 13 min) and the KV-cache curve; about 60 min on an otherwise idle 2-core machine, plus the peer builds the
# first time. BENCH_ISA=host skips the AVX2 pass (and its peer).
BENCH_ISA ?= host,avx2
comma := ,
bench: pull $(patsubst %,$(PEERS_DIR)/llama-cpp-%/BUILD,$(subst $(comma), ,$(BENCH_ISA))) bench-models $(VENV)/.bench-installed
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/detinfer bench --isa $(BENCH_ISA) --peer llama-cpp --peers-dir $(PEERS_DIR) \
		--model smollm2-135m-instruct-q4_1 --model gemma3-270m-q4_k_m $(LARGE_MODELS:%=--large-model %) --large-runs 2 \
		--out bench/results.json --markdown docs/benchmarks.md
	$(BIN)/detinfer bench kv --plot docs/kv.png --results bench/results.json --markdown docs/benchmarks.md
	$(MAKE) bench-busy
	$(MAKE) bench-speculate
	$(MAKE) bench-serve
	$(MAKE) bench-lockstep
	$(MAKE) profile

# Idle and beside a busy loop holding one core: detinfer at 1, 2 and its default threads, llama.cpp (the host peer)
# at 1 and 2, then a real server at --threads 1 and its default under 4 concurrent clients, both models
# (detinfer/bench/busy.py), into bench/busy.json and a section of docs/benchmarks.md; about 10 min.
bench-busy: pull $(PEERS_DIR)/llama-cpp-host/BUILD $(VENV)/.bench-installed
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/detinfer bench busy --peer --peers-dir $(PEERS_DIR) --out bench/busy.json --markdown docs/benchmarks.md

# Decode with and without --speculate ngram, on a task that quotes a tool result from its context and on free text,
# both models at 1 and 2 threads, every run checked byte for byte (bench/speculate.py), beside llama.cpp's own prompt
# lookup on the same prompts (the host peer), into bench/speculate.json and a section of docs/benchmarks.md; about 8 min.
bench-speculate: pull $(PEERS_DIR)/llama-cpp-host/BUILD $(VENV)/.bench-installed
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/detinfer bench speculate --peer --peers-dir $(PEERS_DIR) --out bench/speculate.json --markdown docs/benchmarks.md

# A real `detinfer serve` under 1, 2, 4 and 8 concurrent streaming clients at --batch 1, 4 and 8, both
# models at 1 and 2 threads, every response checked against the same request alone (bench/serve.py), into bench/serve.json
# and a section of docs/benchmarks.md; about 5 min.
bench-serve: pull
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/detinfer bench serve --out bench/serve.json --markdown docs/benchmarks.md

# detinfer verify (manifests/, and a folder of decode-heavy manifests) and detinfer batch, one file at a time and in
# lockstep (--batch 1 and the default), both models, 1 and 2 threads, as detinfer processes; every verify matches and the
# batch folders are byte-identical (bench/lockstep.py), into bench/lockstep.json and a section of docs/benchmarks.md.
bench-lockstep: pull
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/detinfer bench lockstep --out bench/lockstep.json --markdown docs/benchmarks.md

# Where the time goes (bench/profile.py): every kernel call of a real prefill of 512 tokens and 64 decode steps, both
# models at 1 and 2 threads, as a section of docs/benchmarks.md beside PROFILE_BEFORE (the same run on the commit this
# issue started from); about 5 min on an otherwise idle 2-core machine.
PROFILE_BEFORE ?= bench/profile-468ce09.json
profile: pull
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/python bench/profile.py --out bench/profile.json --markdown docs/benchmarks.md \
		$(if $(wildcard $(PROFILE_BEFORE)),--before $(PROFILE_BEFORE))

# docs/scale.md's table: verify manifests/ and a 50-prompt batch without Ray, on 1 Ray actor x 2 threads and on 2 x 1,
# plus Ray's overhead per item (bench/scale.json); about 10 min on an otherwise idle 2-core machine.
scale: pull
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/python bench/scale.py

fuzz: pull
	$(BIN)/python tests/fuzz.py --examples 10000 --report docs/reliability.md

clean:
	rm -rf $(VENV) .numba-boundscheck .portability .bench run.json
