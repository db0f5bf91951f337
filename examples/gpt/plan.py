#!/usr/bin/env python3
"""`pacer plan step` and `pacer plan memory` for this example's model, beside what a run measured.

    python3 examples/gpt/plan.py step   --config 1b --vocab 8000 --seq-len 2048 --batch-size 8 [--vet VET.json] [--summary S.json]
    python3 examples/gpt/plan.py memory --config 1b --vocab 8000 --seq-len 2048 --batch-size 8 [--gpu-memory 80GiB]

pacer's model is GPT-shaped (four h x h attention matrices, a two-matrix MLP). This decoder has
grouped-query attention (K and V narrower) and a three-matrix SwiGLU MLP, so it is described to
pacer with the MLP width that gives the same matrix FLOPs per layer (`equivalent_ffn`); the
attention core, the vocabulary and the layer count are the model's own. Left out by pacer's
model: the untied output layer counts once (pacer ties it, and adds learned positions this
model has not: about 1% of the 1b config's parameters) and RMSNorm's float32 pass.

Hardware: `--vet` takes a `pacer vet --json` report. With GPU figures in it pacer uses them;
without (a CPU node) this script passes the CPU's measured `cpu.flops` and `memory.bandwidth`
as the GEMM rate, the peak and the memory bandwidth, in float32.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as gpt  # noqa: E402

# bf16 dense peak of the GPUs this example has run on (datasheets), for MFU when no --peak-tflops is given.
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def pacer_bin(who="plan", hint=""):
    path = shutil.which(os.environ.get("PACER_BIN") or "pacer")
    if not path:
        raise SystemExit(f"{who}: pacer not found (set $PACER_BIN to build/bin/pacer or put pacer on PATH{', ' + hint if hint else ''})")
    return path


def equivalent_ffn(c):
    """The two-matrix MLP width whose FLOPs plus 4h^2 attention equal this layer's matrices (GQA, SwiGLU)."""
    head = c.dim // c.heads
    attn = c.dim * head * (2 * c.heads + 2 * c.kv_heads)
    matrices = attn + 3 * c.dim * c.ffn_dim
    return max(1, round((matrices - 4 * c.dim * c.dim) / (2 * c.dim)))


def model_args(cfg, seq_len, batch_size, world=1):
    return ["--layers", str(cfg.layers), "--hidden", str(cfg.dim), "--heads", str(cfg.heads), "--seq", str(seq_len),
            "--vocab", str(cfg.vocab_size), "--ffn", str(equivalent_ffn(cfg)), "--micro-batch", str(batch_size),
            "--dp", str(world)]


def _vet_checks(path):
    with open(path) as f:
        report = json.load(f)
    return {c.get("name"): c for c in report.get("checks", []) if c.get("status") in ("pass", "warn")}


def hardware_args(vet=None, gpu_name=None, world=1):
    """pacer plan step's hardware options: the vet report's GPU figures, else its CPU figures in float32."""
    if not vet:
        return []
    checks = _vet_checks(vet)
    if "gpu.gemm_bf16" in checks:
        args = ["--vet", vet]
        if world > 1 and "network.busbw_gbps" not in checks and "gpu.nccl_busbw" in checks:
            # Data-parallel ranks of one node reduce over NVLink: its all-reduce bandwidth is theirs.
            args += ["--dp-gbps", f"{float(checks['gpu.nccl_busbw']['value']):.6g}"]
        name = gpu_name or str(checks.get("gpu.name", {}).get("value") or "")
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        if peak:
            args += ["--peak-tflops", str(peak)]
        return args
    if "cpu.flops" in checks and "memory.bandwidth" in checks:
        tflops = float(checks["cpu.flops"]["value"]) / 1000.0
        mem = f"{float(checks['memory.bandwidth']['value']):.6g}"
        # Ranks of one CPU node reduce through memory (gloo over loopback): its bandwidth stands in for the network's.
        return ["--gemm-tflops", f"{tflops:.6g}", "--peak-tflops", f"{tflops:.6g}", "--hbm-gbps", mem,
                "--dp-gbps", mem, "--precision", "fp32", "--grad-precision", "fp32"]
    return ["--vet", vet]


def run_pacer(args, json_out=True):
    cmd = [pacer_bin(), "plan", *args] + (["--json"] if json_out else [])
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return r.returncode, r.stdout, r.stderr, cmd


def memory_estimate(cfg, seq_len, batch_size, world=1, gpu_memory=None):
    """pacer plan memory's table for this model (text), or the reason it could not be had."""
    args = ["memory", *model_args(cfg, seq_len, batch_size, world)]
    if gpu_memory:
        args += ["--gpu-memory", str(gpu_memory)]
    try:
        code, out, err, _ = run_pacer(args, json_out=False)
    except SystemExit as e:
        return str(e)
    return (out + err).strip() if code in (0, 1) else f"pacer plan memory exited {code}: {err.strip()}"


def measured(summary):
    """A train.py --summary file: its median_step_s leaves out the warm-up and the steps that saved."""
    with open(summary) as f:
        return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["step", "memory"])
    ap.add_argument("--config", default="tiny", help=f"one of {', '.join(gpt.CONFIGS)}")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True, help="rows per rank per step")
    ap.add_argument("--world", type=int, default=1, help="data-parallel ranks")
    ap.add_argument("--vet", help="a pacer vet --json report (hardware figures)")
    ap.add_argument("--gpu-memory", help="plan memory: the GPU's memory, e.g. 80GiB")
    ap.add_argument("--summary", help="a train.py --summary file: the measured step time beside the prediction")
    ap.add_argument("--json", action="store_true", help="print one JSON object (pacer.example.gpt.plan/1)")
    a, extra = ap.parse_known_args(argv)
    cfg = gpt.config(a.config, a.vocab, max_seq_len=max(a.seq_len, 2048))
    if a.what == "memory":
        print(memory_estimate(cfg, a.seq_len, a.batch_size, a.world, a.gpu_memory))
        return 0
    args = ["step", *model_args(cfg, a.seq_len, a.batch_size, a.world), *hardware_args(a.vet, world=a.world), *extra]
    code, out, err, cmd = run_pacer(args)
    if code != 0:
        print(f"plan: {' '.join(cmd)} exited {code}: {err.strip()}", file=sys.stderr)
        return 2
    plan = json.loads(out)
    result = {"schema": "pacer.example.gpt.plan/1", "command": cmd, "equivalent_ffn": equivalent_ffn(cfg),
              "parameters": gpt.parameter_count(cfg), "predicted": {k: plan.get(k) for k in ("step_s", "tokens_per_s", "mfu")},
              "plan": plan}
    if a.summary:
        s = measured(a.summary)
        step = s["median_step_s"]
        result["measured"] = {"step_s": step, "tokens_per_s": s["tokens_per_s"],
                              # the same FLOPs and peak as the prediction's, over the measured time
                              "mfu": plan["mfu"] * plan["step_s"] / step if plan.get("mfu") and step else None}
        result["measured_over_predicted"] = step / plan["step_s"] if plan.get("step_s") else None
    if a.json:
        print(json.dumps(result, indent=1))
        return 0
    _, table, _, _ = run_pacer(args, json_out=False)
    print(table.rstrip())
    print(f"model {a.config}: {result['parameters']:,} parameters; described to pacer with --ffn {result['equivalent_ffn']} "
          f"(GQA + SwiGLU as an equivalent MLP)")
    if "measured" in result:
        m, p = result["measured"], result["predicted"]
        mfu = f", MFU {m['mfu']:.1%} (predicted {p['mfu']:.1%})" if m["mfu"] is not None else ""
        print(f"measured: step {m['step_s'] * 1e3:.1f} ms (predicted {p['step_s'] * 1e3:.1f} ms, "
              f"{result['measured_over_predicted']:.2f}x), {m['tokens_per_s']:,.0f} tokens/s "
              f"(predicted {p['tokens_per_s']:,.0f}){mfu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
