"""`pacer plan step` against a real PyTorch training step on one GPU.

Usage (GPU machine): python3 bench/plan_vs_torch.py PACER_BINARY [--rounds 3] [--out DIR]

Trains a GPT-style model (learned positions, pre-LayerNorm blocks, 4h GeLU MLP, tied
output layer, fp32 cross entropy) with PyTorch: fp32 weights under bf16 autocast, fused
AdamW and gradient-norm clipping, as a mixed-precision run does. Three variants:

- fused attention (torch's scaled_dot_product_attention, causal: a FlashAttention
  kernel), eager;
- the same under torch.compile, which fuses the element-wise kernels as Megatron's
  hand-fused ones do (pacer's model counts fused ones);
- unfused attention, eager: the scores materialised (baddbmm with the scale, causal
  mask, softmax, attention over V), as Megatron's core without its fused softmax.

Each round measures the GPU's sustained GEMM rate (8192^3 bf16, 1 s back to back, median
batch, as `pacer vet` does) and copy bandwidth (4 GiB device copies) next to the timing,
gives them to `pacer plan step` with the same model (`--flash-attention` for the fused
core), and compares. Inputs are random tokens; a step time is the median of 10 steps, after
3 untimed ones per model (compilation included); the table gives medians over rounds.
"""
import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from torch import nn

from gpu_rates import copy_gbps, gemm_tflops


class Block(nn.Module):
    def __init__(self, h, heads, fused):
        super().__init__()
        self.heads, self.fused = heads, fused
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def attention(self, q, k, v):
        if self.fused:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b, a, s, d = q.shape
        q, k, v = q.reshape(b * a, s, d), k.reshape(b * a, s, d), v.reshape(b * a, s, d)
        scores = torch.baddbmm(torch.empty(b * a, s, s, device=q.device, dtype=q.dtype), q, k.transpose(1, 2),
                               beta=0.0, alpha=1 / math.sqrt(d))
        mask = torch.ones(s, s, device=q.device, dtype=torch.bool).triu_(1)
        probs = torch.softmax(scores.masked_fill_(mask, float("-inf")), dim=-1)
        return torch.bmm(probs, v).view(b, a, s, d)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        o = self.attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(o)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers, h, heads, seq, vocab, fused):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads, fused) for _ in range(layers))
        self.ln = nn.LayerNorm(h)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln(x) @ self.embed.weight.t()  # tied output layer
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def sdpa_kernels(cfg):
    """Names of the GPU kernels torch's default causal scaled_dot_product_attention runs for this shape."""
    d = cfg["hidden"] // cfg["heads"]
    q, k, v = (torch.randn(cfg["micro_batch"], cfg["heads"], cfg["seq"], d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    return sorted(n for n in names if any(w in n.lower() for w in ("flash", "fmha", "cudnn", "sm90", "sm80"))
                  and not n.startswith("aten::"))


class Trainer:
    """One model, its optimizer and a training step: fp32 weights, bf16 autocast, fused AdamW, clipping."""

    def __init__(self, cfg, fused, compiled):
        torch.manual_seed(0)
        self.model = GPT(cfg["layers"], cfg["hidden"], cfg["heads"], cfg["seq"], cfg["vocab"], fused).cuda()
        self.forward = torch.compile(self.model) if compiled else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        b, s = cfg["micro_batch"], cfg["seq"]
        self.tokens = torch.randint(0, cfg["vocab"], (b, s), device="cuda")
        self.targets = torch.randint(0, cfg["vocab"], (b, s), device="cuda")

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.forward(self.tokens, self.targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        return loss

    def seconds(self, steps=10):
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = self.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        assert torch.isfinite(loss).item()
        return statistics.median(times)


def pacer_step(pacer, cfg, fused, gemm, hbm):
    cmd = [pacer, "plan", "step", "--json", "--layers", str(cfg["layers"]), "--hidden", str(cfg["hidden"]),
           "--heads", str(cfg["heads"]), "--seq", str(cfg["seq"]), "--vocab", str(cfg["vocab"]),
           "--micro-batch", str(cfg["micro_batch"]), "--gemm-tflops", str(gemm), "--hbm-gbps", str(hbm),
           "--precision", "bf16", "--grad-precision", "fp32"]
    if fused:
        cmd.append("--flash-attention")
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pacer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    configs = [
        {"name": "1.8B h4096 s2048 b2", "layers": 8, "hidden": 4096, "heads": 32, "seq": 2048, "vocab": 51200, "micro_batch": 2},
        {"name": "0.7B h2048 s4096 b2", "layers": 12, "hidden": 2048, "heads": 16, "seq": 4096, "vocab": 51200, "micro_batch": 2},
    ]
    variants = [("fused", False), ("fused", True), ("unfused", False)]  # (attention core, torch.compile)
    table = []
    for cfg in configs:
        cfg["sdpa_kernels"] = sdpa_kernels(cfg)
        print(f"{cfg['name']}: scaled_dot_product_attention runs {cfg['sdpa_kernels']}", flush=True)
        for attention, compiled in variants:
            trainer = Trainer(cfg, attention == "fused", compiled)
            t0 = time.perf_counter()
            for _ in range(3):  # untimed: compilation, autotuning, allocator warm-up
                trainer.step()
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            rounds = []
            for r in range(args.rounds):
                gemm, hbm = gemm_tflops(), copy_gbps()  # the GPU's rates next to each timing
                torch.cuda.reset_peak_memory_stats()  # the peak of training, not of the rate buffers
                measured = trainer.seconds()
                plan = pacer_step(args.pacer, cfg, attention == "fused", gemm, hbm)
                rounds.append({"gemm_tflops": gemm, "copy_gbps": hbm, "measured_s": measured, "pacer_s": plan["step_s"],
                               "pacer_breakdown_s": plan["breakdown_s"]})
                print(f"{cfg['name']:<22} {attention:<8} {'compiled' if compiled else 'eager':<8} round {r}: measured"
                      f" {measured * 1e3:7.1f} ms, pacer {plan['step_s'] * 1e3:7.1f} ms (GEMM {gemm:.0f} TFLOP/s,"
                      f" copy {hbm:.0f} GB/s)", flush=True)
            peak = torch.cuda.max_memory_allocated() / 2**30
            del trainer
            torch.cuda.empty_cache()
            ratios = [rd["measured_s"] / rd["pacer_s"] for rd in rounds]
            table.append({"config": cfg["name"], "attention": attention, "compiled": compiled, "warmup_s": warm_s,
                          "peak_gib": peak, "measured_s": statistics.median(rd["measured_s"] for rd in rounds),
                          "pacer_s": statistics.median(rd["pacer_s"] for rd in rounds),
                          "measured_over_pacer": statistics.median(ratios), "rounds": rounds})
    print(f"{'config':<22} {'attention':<9} {'torch':<9} {'measured':>10} {'pacer':>10} {'measured/pacer':>15}")
    for t in table:
        print(f"{t['config']:<22} {t['attention']:<9} {'compiled' if t['compiled'] else 'eager':<9}"
              f" {t['measured_s'] * 1e3:8.1f}ms {t['pacer_s'] * 1e3:8.1f}ms {t['measured_over_pacer']:>15.3f}")
    result = {"date": datetime.date.today().isoformat(), "host": platform.node(), "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "configs": configs, "table": table}
    path = os.path.join(args.out, "plan_vs_torch.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
