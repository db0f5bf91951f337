#!/usr/bin/env python3
"""Side by side: the pacer loop and the usual loop (train.py --summary files), with pacer plan step and pacer score.

    python3 examples/gpt/compare.py --pacer P.json --baseline B.json [--plan PLAN.json] [--score SCORE.json] \
        [--machine TEXT] --name NAME --out DIR

Writes DIR/NAME.json (pacer.example.gpt.bench/1) and DIR/NAME.md, and prints the table.
GPU seconds lost per checkpoint: the timed steps' wall time minus as many steps at the median
step time without a save, over the saves among them (so it holds the save's own blocking and any
slowdown of the steps around it while a background write runs). The last step is left out: its
save waits until the checkpoint is durable, with no step left to overlap (its own row).
"""
import argparse
import json
import os
import time


def load(path):
    with open(path) as f:
        return json.load(f)


def pct(x):
    return "-" if x is None else f"{100 * x:.2f}%"


def num(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pacer", required=True)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--plan", help="examples/gpt/plan.py step --json output")
    ap.add_argument("--score", help="pacer score --json output")
    ap.add_argument("--machine", default="", help="a line describing the machine (uptime, GPU)")
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    p, b = load(a.pacer), load(a.baseline)
    for s in (p, b):  # a later save's cost over the interval's steps: the share a long run settles at
        later, every, step = s.get("later_save_blocking_s"), s.get("ckpt_every"), s.get("median_step_s")
        s["steady_ckpt_blocking_fraction"] = later / (later + every * step) if later is not None and every and step else None
    plan = load(a.plan) if a.plan and os.path.exists(a.plan) else None
    score = load(a.score) if a.score and os.path.exists(a.score) else None
    rows = [("median step time (s, no save)", "median_step_s", num),
            ("tokens/s", "tokens_per_s", lambda x: num(x, "{:,.0f}")),
            ("data wait (% of step time)", "data_wait_fraction", pct),
            ("checkpoint blocking (% of training time, last save aside)", "ckpt_blocking_fraction", pct),
            ("checkpoint blocking at that interval, later saves' cost (steady state)", "steady_ckpt_blocking_fraction", pct),
            ("checkpoint every (steps)", "ckpt_every", lambda x: str(x)),
            ("saves during training (timed)", "timed_saves", lambda x: str(x)),
            ("first save blocking (s)", "first_save_blocking_s", num),
            ("later saves blocking, median (s)", "later_save_blocking_s", num),
            ("last save, until durable (s)", "final_save_s", num),
            (f"time to {p['timed_steps']} steps incl. checkpoints (s)", "time_to_steps_s", num),
            ("GPU seconds lost per checkpoint", "lost_per_ckpt_s", num)]
    result = {"schema": "pacer.example.gpt.bench/1", "name": a.name, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": a.machine, "config": p["config"], "parameters": p["parameters"], "world": p["world"],
              "batch_size": p["batch_size"], "seq_len": p["seq_len"], "dtype": p["dtype"], "device": p["device"],
              "mtbf_assumed": p["mtbf"], "restart_cost_assumed": p["restart_cost"], "plan_ckpt": p.get("plan_ckpt"),
              "pacer": {k: v for k, v in p.items() if k not in ("step_time_s", "data_wait_s")},
              "baseline": {k: v for k, v in b.items() if k not in ("step_time_s", "data_wait_s")},
              "pacer_step_time_s": p["step_time_s"], "baseline_step_time_s": b["step_time_s"]}
    lp, lb = p.get("lost_per_ckpt_s"), b.get("lost_per_ckpt_s")
    result["ckpt_loss_ratio"] = lb / lp if lp and lb and lp > 0 else None
    lines = [f"# {a.name}", "", f"{result['date_utc']}; {a.machine}".rstrip("; "), "",
             f"model `{p['config']}` ({p['parameters']:,} parameters), {p['world']} rank(s), batch {p['batch_size']} x "
             f"{p['seq_len']} tokens per rank, {p['dtype']}, {p['device']}; checkpoint interval from `pacer plan ckpt` "
             f"with MTBF {p['mtbf']} (assumed) and restart {p['restart_cost']}; the first "
             f"{p['warmup_steps_left_out']} steps of each loop are left out of the timings.", "",
             "| | pacer loop | usual loop (DataLoader, torch.save) |", "|---|---|---|"]
    for label, key, fmt in rows:
        lines.append(f"| {label} | {fmt(p.get(key))} | {fmt(b.get(key))} |")
    if result["ckpt_loss_ratio"]:
        lines.append(f"\nThe usual loop loses {result['ckpt_loss_ratio']:.1f}x the GPU time per checkpoint that the pacer loop loses.")
    if plan:
        pr, me = plan["predicted"], plan.get("measured", {})
        result["plan_step"] = {"predicted": pr, "measured": me, "measured_over_predicted": plan.get("measured_over_predicted"),
                               "equivalent_ffn": plan.get("equivalent_ffn"), "command": plan.get("command")}
        lines += ["", "| pacer plan step | predicted | measured (pacer loop) |", "|---|---|---|",
                  f"| step time (s) | {num(pr.get('step_s'))} | {num(me.get('step_s'))} |",
                  f"| tokens/s | {num(pr.get('tokens_per_s'), '{:,.0f}')} | {num(me.get('tokens_per_s'), '{:,.0f}')} |",
                  f"| MFU | {pct(pr.get('mfu'))} | {pct(me.get('mfu'))} |",
                  "", f"`{' '.join(os.path.basename(c) if i == 0 else c for i, c in enumerate(plan.get('command', [])))}`"]
    if score:
        result["score"] = score
        verdict = score.get("verdict") or score.get("bound") or score.get("summary")
        lines += ["", f"pacer score: {json.dumps(verdict) if not isinstance(verdict, str) else verdict}"]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, a.name + ".md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
