"""The attention core against pacer plan's roofline, measured on one GPU.

Usage (GPU machine): python3 bench/attention_roofline.py [--rounds 3] [--out DIR]

`pacer plan step` times the attention core (QK^T and attention over V, one batched
GEMM per head, inner dimension the head size d) as the larger of its FLOPs over the
GEMM rate and its bytes over the memory bandwidth: each GEMM moves the s x s scores
once (written by QK^T, read by the other) plus q, k or v and the output, 2 (s^2 + 2 s d)
bytes per head in bf16, for 2 s^2 d FLOPs. This script measures, in one run:

- the GEMM rate: 8192^3 bf16 matmuls back to back (0.3 s warm-up, then 1 s in 50 ms
  batches, median batch), as `pacer vet`'s gpu.gemm_bf16 does;
- the memory bandwidth: 4 GiB device-to-device copies (read + write bytes), median;
- both attention GEMMs at s = 2048 for head sizes 64 to 256 on 64 (batch x head)
  matrices, timed the same way as the large GEMM,

and prints the measured time over the roofline time and over the FLOP-only time (what
the model used before the roofline). It also times torch's causal
scaled_dot_product_attention on each fused backend (forward, and forward + backward)
against what `pacer plan --flash-attention` charges: the causal blocks at the GEMM rate,
five backward GEMMs against the forward's two. Inputs are random normal bf16, never zeros.
Rounds repeat everything; the table gives medians over rounds.
"""
import argparse
import datetime
import json
import os
import platform
import statistics

import torch

from gpu_rates import copy_gbps, gemm_tflops, sustained


def attention(d, s=2048, bh=64):
    q = torch.randn(bh, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(bh, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(bh, s, d, device="cuda", dtype=torch.bfloat16)
    p = torch.softmax(torch.randn(bh, s, s, device="cuda", dtype=torch.bfloat16), dim=-1)
    scores = torch.empty(bh, s, s, device="cuda", dtype=torch.bfloat16)
    context = torch.empty(bh, s, d, device="cuda", dtype=torch.bfloat16)
    qk = sustained(lambda: torch.bmm(q, k.transpose(1, 2), out=scores))
    pv = sustained(lambda: torch.bmm(p, v, out=context))
    flops = 2 * s * s * d * bh
    bytes_moved = 2 * (s * s + 2 * s * d) * bh
    return qk, pv, flops, bytes_moved


def fused_attention(d, backend, s=2048, b=4, heads=16):
    """Causal scaled_dot_product_attention on one backend: forward, and forward + backward, seconds."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16)
    kernel = getattr(SDPBackend, backend)

    def forward():
        with torch.no_grad(), sdpa_kernel([kernel]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward_backward():
        with sdpa_kernel([kernel]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        q.grad = k.grad = v.grad = None
        out.backward(grad)

    try:
        forward_backward()
    except RuntimeError as e:  # backend not available for this shape or build
        return None, None, str(e).splitlines()[0]
    return sustained(forward), sustained(forward_backward), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", default="64,80,96,128,160,256")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--backends", default="FLASH_ATTENTION,CUDNN_ATTENTION,EFFICIENT_ATTENTION")
    args = ap.parse_args()
    heads = [int(x) for x in args.heads.split(",")]
    backends = args.backends.split(",")
    rounds = []
    for r in range(args.rounds):
        rate = gemm_tflops() * 1e12
        bw = copy_gbps() * 1e9
        rows = []
        for d in heads:
            qk, pv, flops, nbytes = attention(d)
            roof = max(flops / rate, nbytes / bw)
            rows.append({"head_size": d, "qk_s": qk, "pv_s": pv, "flops": flops, "bytes": nbytes,
                         "flop_only_s": flops / rate, "roofline_s": roof})
        fused = []
        for d in heads:
            for backend in backends:
                fwd, fwd_bwd, error = fused_attention(d, backend)
                # pacer plan's --flash-attention: the causal blocks (of s/128 block rows, n(n+1)/2 of n^2) at
                # the GEMM rate; forward 2 GEMMs of 2 s^2 d per (batch, head), backward 5.
                n = 2048 / 128
                flops = (n + 1) / (2 * n) * 4 * 2048 * 2048 * d * 4 * 16
                fused.append({"head_size": d, "backend": backend, "forward_s": fwd, "forward_backward_s": fwd_bwd,
                              "error": error, "model_forward_s": flops / rate, "model_forward_backward_s": 3.5 * flops / rate})
        rounds.append({"gemm_flops_per_s": rate, "copy_bytes_per_s": bw, "rows": rows, "fused": fused})
        print(f"round {r}: GEMM {rate / 1e12:.0f} TFLOP/s, copy {bw / 1e9:.0f} GB/s", flush=True)

    med = statistics.median
    table = []
    for i, d in enumerate(heads):
        get = lambda key: med(rd["rows"][i][key] for rd in rounds)
        row = {"head_size": d, "balance_flop_per_byte": None}
        for g in ("qk", "pv"):
            meas = get(f"{g}_s")
            row[f"{g}_measured_s"] = meas
            row[f"{g}_over_roofline"] = med(rd["rows"][i][f"{g}_s"] / rd["rows"][i]["roofline_s"] for rd in rounds)
            row[f"{g}_over_flop_only"] = med(rd["rows"][i][f"{g}_s"] / rd["rows"][i]["flop_only_s"] for rd in rounds)
        row["flop_per_byte"] = rounds[0]["rows"][i]["flops"] / rounds[0]["rows"][i]["bytes"]
        table.append(row)
    rate = med(rd["gemm_flops_per_s"] for rd in rounds)
    bw = med(rd["copy_bytes_per_s"] for rd in rounds)
    balance = rate / bw
    for row in table:
        row["balance_flop_per_byte"] = balance
    print(f"GEMM {rate / 1e12:.0f} TFLOP/s, copy {bw / 1e9:.0f} GB/s: balance {balance:.0f} FLOP/byte")
    print(f"{'d':>4} {'FLOP/B':>7} {'QK^T/roof':>10} {'PV/roof':>8} {'QK^T/FLOP-only':>15} {'PV/FLOP-only':>13}")
    for row in table:
        print(f"{row['head_size']:>4} {row['flop_per_byte']:>7.1f} {row['qk_over_roofline']:>10.2f} {row['pv_over_roofline']:>8.2f}"
              f" {row['qk_over_flop_only']:>15.2f} {row['pv_over_flop_only']:>13.2f}")
    fused_table = []
    for i, f in enumerate(rounds[0]["fused"]):
        runs = [rd["fused"][i] for rd in rounds]
        if f["forward_s"] is None:
            fused_table.append({"head_size": f["head_size"], "backend": f["backend"], "error": f["error"]})
            continue
        fused_table.append({"head_size": f["head_size"], "backend": f["backend"],
                            "forward_s": med(r["forward_s"] for r in runs),
                            "forward_backward_s": med(r["forward_backward_s"] for r in runs),
                            "forward_over_model": med(r["forward_s"] / r["model_forward_s"] for r in runs),
                            "forward_backward_over_model": med(r["forward_backward_s"] / r["model_forward_backward_s"] for r in runs)})
    print("fused causal attention (b 4, 16 heads, s 2048): measured time over pacer plan's --flash-attention")
    print(f"{'d':>4} {'backend':<20} {'forward':>8} {'fwd+bwd':>8}")
    for f in fused_table:
        if "error" in f:
            print(f"{f['head_size']:>4} {f['backend']:<20} unavailable: {f['error']}")
        else:
            print(f"{f['head_size']:>4} {f['backend']:<20} {f['forward_over_model']:>8.2f} {f['forward_backward_over_model']:>8.2f}")
    result = {
        "date": datetime.date.today().isoformat(),
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "seq": 2048,
        "matrices": 64,
        "gemm_tflops": rate / 1e12,
        "copy_gbps": bw / 1e9,
        "table": table,
        "fused_table": fused_table,
        "rounds": rounds,
    }
    path = os.path.join(args.out, "attention_roofline.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
