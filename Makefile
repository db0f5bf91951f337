# Pacer's front door. `make vet` and `make test` work on a fresh Debian 12
# machine: each installs what is missing, builds, then vets or tests.
BUILD ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
VET_ARGS ?=
CTEST_ARGS ?=
# ON: also build build/sanitize (ASan + UBSan, libFuzzer) and run its tests (docs/fuzzing.md).
SANITIZE ?= OFF

.PHONY: all deps build vet test test-slow bench clean

all: build

deps:
	@bash scripts/deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DPACER_SANITIZED_TESTS=$(SANITIZE) -DPACER_FUZZ=$(SANITIZE) >/dev/null
	@cmake --build $(BUILD) -j$(JOBS)

vet: build
	$(BUILD)/bin/pacer vet $(VET_ARGS)

# Unit, integration, crash and Slurm tests. test-slow adds the long crash
# loops and soak tests (PACER_SLOW_TESTS=1) and the sanitized tree: the unit
# and Python tests again under ASan + UBSan, and fuzzing (SANITIZE=ON).
test: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS) $(CTEST_ARGS)

test-slow:
	@$(MAKE) --no-print-directory build SANITIZE=ON
	cd $(BUILD) && PACER_SLOW_TESTS=1 ctest --output-on-failure -j$(JOBS) $(CTEST_ARGS)

# Side-by-side benchmarks against peer tools; results go to bench/results/.
bench: build
	bash bench/vet_peers.sh
	bash bench/ckpt_vs_torch.sh $(BUILD)
	bash bench/telemetry_bench.sh $(BUILD)

clean:
	rm -rf $(BUILD)
