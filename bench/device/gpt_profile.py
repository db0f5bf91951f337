"""Where the reference model's step time goes on one GPU: the same 1b step under several attention forms.

Explains the gap between `pacer plan step` (which counts matrix and attention FLOPs at the GPU's measured
rate) and the measured step of examples/gpt. Each variant changes one thing against the one before;
rounds alternate the variants so that clocks and heat treat them alike; medians and spreads per variant.

    python3 bench/device/gpt_profile.py --out DIR [--rounds 3] [--steps 6]

Writes DIR/gpt_profile.json and DIR/gpt_profile_top_kernels.txt (torch.profiler, the example's own form).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "gpt"))
import model as gpt  # noqa: E402


def batch(b, n, vocab, gen, mean_doc=600):
    """Random tokens packed into rows of documents with exponential lengths (position ids restart at 0)."""
    tokens = torch.randint(0, vocab, (b, n), generator=gen)
    pos = torch.empty(b, n, dtype=torch.long)
    for r in range(b):
        i = 0
        while i < n:
            length = max(1, int(-mean_doc * math.log(1.0 - torch.rand(1, generator=gen).item())))
            length = min(length, n - i)
            pos[r, i:i + length] = torch.arange(length)
            i += length
    return tokens, pos


def sdpa_dense(self, x, cos, sin, mask):
    return gpt.Attention.forward_original(self, x, cos, sin, mask)


def projections(self, x, cos, sin):
    """The example's query, key and value heads, RoPE applied, without repeating the key/value heads."""
    b, n, _ = x.shape
    q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
    k = self.k(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
    v = self.v(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
    return gpt.apply_rope(q, cos, sin), gpt.apply_rope(k, cos, sin), v


def sdpa_causal(self, x, cos, sin, mask):
    """Causal attention over the whole row (documents see each other): the flash kernel, GQA without copies."""
    b, n, _ = x.shape
    q, k, v = projections(self, x, cos, sin)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return self.o(y.transpose(1, 2).reshape(b, n, -1))


FLEX = {}


def flex_doc(self, x, cos, sin, mask):
    """Document-causal attention through flex_attention: the example's own form, with the batch's block mask."""
    return gpt.Attention.forward_original(self, x, cos, sin, FLEX["mask"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting rounds after this long")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t_start = time.monotonic()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = gpt.config(a.config, a.vocab, max_seq_len=a.seq)
    m = gpt.GPT(cfg, attention="sdpa").to(dev)  # the dense mask; the flex variants build their own block mask
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    data = [tuple(t.to(dev) for t in batch(a.batch, a.seq, a.vocab, gen)) for _ in range(4)]
    gpt.Attention.forward_original = gpt.Attention.forward

    variants = {
        # name: (attention forward, deterministic, what it changes)
        "example": (sdpa_dense, True, "as examples/gpt trains: dense document mask in SDPA, deterministic algorithms"),
        "nondeterministic": (sdpa_dense, False, "the same without torch.use_deterministic_algorithms"),
        "flex_document_deterministic": (flex_doc, True, "document-causal mask through flex_attention (block-sparse), "
                                        "GQA without copies, deterministic algorithms"),
        "flex_document": (flex_doc, False, "the same without torch.use_deterministic_algorithms"),
        "causal_flash": (sdpa_causal, False, "plain causal SDPA over the row (flash kernel; documents see each other)"),
    }
    if gpt._flex()[0] is None:
        print(f"flex_attention unavailable in torch {torch.__version__}", flush=True)
        variants.pop("flex_document")
        variants.pop("flex_document_deterministic")

    def step(tokens, pos):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(tokens, pos)
        labels = gpt.labels_for(tokens, pos, torch.full((tokens.shape[0],), tokens.shape[1], device=dev))
        loss = gpt.loss_fn(logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def run(name, steps):
        fwd, det, _ = variants[name]
        gpt.Attention.forward = fwd
        torch.use_deterministic_algorithms(det)
        times = []
        for i in range(steps):
            tokens, pos = data[i % len(data)]
            if name.startswith("flex_document"):
                FLEX["mask"] = gpt.document_block_mask(pos)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(tokens, pos)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times

    result = {"schema": "pacer.bench.gpt_profile/1", "config": a.config, "batch": a.batch, "seq": a.seq,
              "parameters": m.parameter_count(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
              "variants": {k: {"what": v[2], "step_s": []} for k, v in variants.items()}, "errors": {}}
    for name in list(variants):  # warm-up (compiles flex) and a check that each variant runs
        try:
            t0 = time.monotonic()
            run(name, 3)
            print(f"warm {name}: {time.monotonic() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001
            result["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
            print(f"{name} failed: {e}", flush=True)
            variants.pop(name)
            result["variants"].pop(name)
    rounds_done = 0
    for r in range(a.rounds):
        if time.monotonic() - t_start > a.budget_s:
            break
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            result["variants"][name]["step_s"] += run(name, a.steps)
        rounds_done += 1
        print(f"round {r}: " + ", ".join(f"{k} {statistics.median(v['step_s']):.4f}" for k, v in result["variants"].items()),
              flush=True)
    result["rounds"] = rounds_done
    base = None
    for name, v in result["variants"].items():
        s = v["step_s"]
        if not s:
            continue
        v["median_s"] = statistics.median(s)
        v["min_s"], v["max_s"] = min(s), max(s)
        base = base or v["median_s"]
        v["vs_example"] = v["median_s"] / base
        v["tokens_per_s"] = a.batch * a.seq / v["median_s"]

    # Bit-identical repeats (what a resume needs): the same weights and batches twice, losses compared bitwise.
    def losses(name, n=4):
        fwd, det, _ = variants[name]
        gpt.Attention.forward = fwd
        torch.use_deterministic_algorithms(det)
        out = []
        for i in range(n):
            tokens, pos = data[i % len(data)]
            if name.startswith("flex_document"):
                FLEX["mask"] = gpt.document_block_mask(pos)
            out.append(step(tokens, pos).float().item())
        return out

    initial = {k: v.detach().clone() for k, v in m.state_dict().items()}
    result["repeatable"] = {}
    for name in variants:
        runs = []
        for _ in range(2):
            with torch.no_grad():
                for k, v in m.state_dict().items():
                    v.copy_(initial[k])
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1)
            runs.append(losses(name))
        result["repeatable"][name] = {"losses": runs, "bit_identical": runs[0] == runs[1]}
        print(f"repeatable {name}: {runs[0] == runs[1]} {runs}", flush=True)

    # Where the example's own step spends its GPU time, by kernel.
    gpt.Attention.forward = sdpa_dense
    torch.use_deterministic_algorithms(True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            step(*data[i % len(data)])
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    with open(os.path.join(a.out, "gpt_profile_top_kernels.txt"), "w") as f:
        f.write(table)
    with open(os.path.join(a.out, "gpt_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "step_s"} for k, v in result["variants"].items()},
                     indent=1))
    print(table[:6000])


if __name__ == "__main__":
    main()
