#!/usr/bin/env bash
# Everything pacer measures with several GPUs of one host, in one run: vet's
# GPU checks on every GPU (peer copies, NCCL all-reduce), NCCL busbw against
# torch.distributed, `vet --cluster` with one logical node per GPU (NCCL
# across "nodes" bootstrapped through MPI), and vet's figures against torch's
# on GPU 0.
#
#   bash bench/multi_gpu.sh [PACER] [OUT]     (defaults: build/bin/pacer, bench/results/multi-gpu)
#
# Needs mpirun (Open MPI), python3 with torch, and 2+ GPUs. NVLink multicast
# stays off (NCCL_NVLS_ENABLE=0): on shared hosts it can take GPUs out of
# service.
set -u
PACER=$(readlink -f "${1:-build/bin/pacer}")
OUT=${2:-bench/results/multi-gpu}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
GPUS=$(nvidia-smi -L | wc -l)
# torch's own NCCL for both sides of the comparison.
export PACER_NCCL_LIBRARY=${PACER_NCCL_LIBRARY:-$(python3 -c 'import glob,os,torch; d=os.path.dirname(os.path.dirname(torch.__file__)); print((sorted(glob.glob(d+"/nvidia/nccl/lib/libnccl.so*")) or [""])[0])')}
step() { echo; echo "== $* ($(date -u +%T))"; }

step "machine"
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=index,name,driver_version,pci.bus_id,temperature.gpu,power.draw --format=csv
  nvidia-smi topo -m
  mpirun --version 2>&1 | head -1
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
  echo "PACER_NCCL_LIBRARY=$PACER_NCCL_LIBRARY"
} 2>&1 | tee "$OUT/machine.txt"

step "pacer vet --only gpu on $GPUS GPUs (h200 profile)"
timeout 170 "$PACER" vet --profile h200 --only gpu --json-file "$OUT/vet-gpu.json" > "$OUT/vet-gpu.txt" 2>&1
echo "exit $?"
grep -E "p2p|nccl|gemm_bf16|FAIL|WARN|ERROR" "$OUT/vet-gpu.txt" | head -30

step "NCCL all-reduce: pacer comm bench vs torch.distributed ($GPUS ranks)"
timeout 180 python3 "$HERE/nccl_vs_torch.py" --pacer "$PACER" --gpus "$GPUS" --out "$OUT/nccl" 2>&1 | tail -12

step "pacer vet --cluster: $GPUS logical nodes, one GPU each"
cat > "$OUT/as_node.sh" <<EOF
#!/bin/sh
export CUDA_VISIBLE_DEVICES=\$OMPI_COMM_WORLD_LOCAL_RANK
exec "$PACER" vet --node-name "gpu\$OMPI_COMM_WORLD_RANK" "\$@"
EOF
chmod +x "$OUT/as_node.sh"
timeout 100 mpirun --oversubscribe -np "$GPUS" -x NCCL_NVLS_ENABLE -x PACER_NCCL_LIBRARY -x LD_LIBRARY_PATH \
  "$OUT/as_node.sh" --cluster --quick --profile h200 --skip storage,cpu,memory.pattern,system.load --bound 90s \
  --json-file "$OUT/vet-cluster.json" > "$OUT/vet-cluster.txt" 2>&1
echo "exit $?"
grep -iE "all-reduce|verdict|nodes" "$OUT/vet-cluster.txt" | head -12

step "vet vs torch on GPU 0"
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 "$HERE/gpu_vs_torch.py" "$PACER" --out "$OUT/gpu0" 2>&1 | tail -12
step "done"
