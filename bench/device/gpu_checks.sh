#!/usr/bin/env bash
# The GPU machine's checks of a build, in one call (bench/README.md, "GPU checks"):
#   here:  bash bench/device/module.sh pack build
#   there: OUT=DIR bash bench/device/gpu_checks.sh       (carry .device)
# Builds the Python module for the machine's Python, then runs the unit tests
# that need a GPU, the Python tests (CUDA ones included), the CLI's GPU paths
# (vet --quick, comm bench over NCCL with one rank, a hang caught by pacer run
# with the GPU's state in its event) and the data benchmarks on
# a quiet many-core host (and the tokenizer on every CPU when spm_encode is carried). Everything goes to $OUT; the exit code is 0 even when
# a step fails, so that every step's log comes back (grep FAILED / rc= lines);
# the logs are also packed into $OUT/logs.tgz, since few files come back.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder the results go to}"
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-} PYTHONPATH=$PWD/.device/python NCCL_NVLS_ENABLE=0
step() {
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? ${name} $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
}
{ date -u; uptime; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__)'; } > "$OUT/machine.txt" 2>&1
step module bash bench/device/module.sh build
step unit .device/bin/pacer_unit_tests --gtest_filter='CheckpointerDevice*:HwNccl*:HwCuda*:*Pinned*:*Gpu*:Nvml*'
step pytests bash -c 'cd tests/python && PACER_BIN=$OLDPWD/.device/bin/pacer python3 -m unittest test_checkpoint_cuda test_checkpoint_state test_data test_data_habits test_data_blend test_tokenize 2>&1'
step vet .device/bin/pacer vet --quick --json
step comm bash -c 'mpirun --allow-run-as-root -np 1 .device/bin/pacer comm bench --backend nccl --max-size 64MiB --iters 5 --json 2>&1 || .device/bin/pacer comm bench --backend nccl --max-size 64MiB --iters 5 --json'
step hang .device/bin/pacer run --hang-timeout 3s --log "$OUT/hang.jsonl" -- python3 tests/run/hang_train.py --steps 20 --hang-at 5
step tokens python3 bench/tokens_vs_memcpy.py --rounds 5 --threads 4 --name tokens_vs_memcpy-h200
step loader python3 bench/loader_vs_torch.py --rounds 5 --open-shards 10000 --name loader_vs_torch-h200
# The tokenizer on every CPU of the host (spm_train and spm_encode carried in .device/bin).
if [ -x .device/bin/spm_encode ]; then
  step tokenize env PATH="$PWD/.device/bin:$PATH" ROUNDS=5 MB=12 NAME=tokenize_vs_spm-h200 bash bench/tokenize_vs_spm.sh .device
fi
cp bench/results/tokens_vs_memcpy-h200.* bench/results/loader_vs_torch-h200.* bench/results/tokenize_vs_spm-h200.* "$OUT/" 2>/dev/null
{ date -u; uptime; } >> "$OUT/machine.txt"
tar -C "$OUT" -czf "$OUT/logs.tgz" --exclude=logs.tgz .
exit 0
