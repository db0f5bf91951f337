"""Integration tests for `pacer plan`: the real binary, its JSON, its explanations and its exit codes."""
import json
import math
import os
import tempfile
import unittest

from cli_util import pacer

GPT175B = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--seq", "2048", "--vocab", "51200"]
A100 = ["--gemm-tflops", "250", "--peak-tflops", "312", "--hbm-gbps", "1631", "--tp-gbps", "230", "--dp-gbps", "22.5"]


class PlanTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-plan-")
        self.addCleanup(self.tmp.cleanup)

    def write(self, name, text):
        path = os.path.join(self.tmp.name, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def run_json(self, *args):
        r = pacer("plan", *args, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)

    def assert_usage_error(self, args, needle):
        r = pacer("plan", *args)
        self.assertEqual(r.returncode, 2, (args, r.stdout, r.stderr))
        self.assertIn(needle, r.stderr)

    def test_amdahl(self):
        j = self.run_json("amdahl", "--serial-fraction", "0.05", "--gpus", "16")
        self.assertEqual(j["schema"], "pacer.plan.amdahl/1")
        self.assertAlmostEqual(j["speedup"], 1 / (0.05 + 0.95 / 16), places=9)
        self.assertAlmostEqual(j["max_speedup"], 20, places=9)
        j = self.run_json("amdahl", "--speedup", "8", "--gpus", "16")
        self.assertAlmostEqual(j["serial_fraction"], 1 / 15, places=12)
        self.assertIsNone(self.run_json("amdahl", "--serial-fraction", "0", "--gpus", "8")["max_speedup"])
        r = pacer("plan", "amdahl", "--serial-fraction", "0.05", "--gpus", "16")
        self.assertEqual(r.returncode, 0)
        self.assertIn("no number of GPUs gives more than 20x", r.stdout)
        self.assert_usage_error(["amdahl", "--speedup", "20", "--gpus", "16"], "superlinear")
        self.assert_usage_error(["amdahl", "--gpus", "16"], "either")
        self.assert_usage_error(["amdahl", "--serial-fraction", "0.1"], "--gpus")

    def test_scaling(self):
        f = 0.02
        rows = "".join(f"{n},{1000 * 1 / (f + (1 - f) / (n / 8))}\n" for n in (8, 16, 32, 64))
        path = self.write("pts.csv", "# gpus and samples/s\ngpus,throughput\n" + rows)
        j = self.run_json("scaling", path, "--predict", "128", "--predict", "4096")
        self.assertEqual(j["schema"], "pacer.plan.scaling/1")
        self.assertAlmostEqual(j["serial_fraction"], f, places=9)
        self.assertEqual([p["gpus"] for p in j["points"]], [8, 16, 32, 64])
        self.assertFalse(j["predictions"][0]["extrapolated_far"])
        self.assertTrue(j["predictions"][1]["extrapolated_far"])
        self.assertTrue(any("4096 GPUs" in w for w in j["warnings"]))
        r = pacer("plan", "scaling", path)
        self.assertIn("fitted serial/communication fraction 0.0200", r.stdout)

    def test_malformed_csv_names_file_and_line(self):
        path = self.write("bad.csv", "gpus,throughput\n8,100\n16,lots\n")
        self.assert_usage_error(["scaling", path], f"{path}:3: column 'throughput'")
        path = self.write("short.csv", "gpus,throughput\n8,100\n16\n")
        self.assert_usage_error(["scaling", path], f"{path}:3:")
        layers = self.write("layers.csv", "layer,time_ms\nembed,3\nblock,-1\n")
        self.assert_usage_error(["pipeline", layers, "--stages", "2", "--microbatches", "4"], f"{layers}:3: column 'time_ms'")
        self.assert_usage_error(["scaling", os.path.join(self.tmp.name, "missing.csv")], "missing.csv")

    def test_pipeline(self):
        text = "layer,time_ms,memory_mb\nembed,6,300\n" + "".join(f"block{i},2,120\n" for i in range(30)) + "head,9,500\n"
        path = self.write("layers.csv", text)
        j = self.run_json("pipeline", path, "--stages", "4", "--microbatches", "16")
        self.assertEqual(j["schema"], "pacer.plan.pipeline/1")
        opt, even = j["optimal"], j["by_count"]
        self.assertEqual(sum(s["layers"] for s in opt["stages"]), 32)
        self.assertLessEqual(opt["max_stage_time_s"], even["max_stage_time_s"])
        self.assertAlmostEqual(j["gain"], even["step_time_s"] / opt["step_time_s"] - 1, places=12)
        self.assertGreater(j["gain"], 0.1)
        self.assertEqual(opt["stages"][0]["in_flight"], 4)
        r = pacer("plan", "pipeline", path, "--stages", "4", "--microbatches", "16", "--schedule", "interleaved", "--chunks", "2")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("OK: the balanced partition", r.stdout)
        self.assert_usage_error(["pipeline", path, "--stages", "40", "--microbatches", "16"], "at least 40 layers")
        self.assert_usage_error(["pipeline", path, "--stages", "4", "--microbatches", "0"], "--microbatches")
        self.assert_usage_error(["pipeline", path, "--stages", "4", "--microbatches", "8", "--schedule", "zigzag"], "zigzag")

    def test_memory(self):
        args = ["memory", *GPT175B, "--tp", "8", "--pp", "8", "--dp", "16", "--global-batch", "1536",
                "--sequence-parallel", "--recompute", "selective", "--distributed-optimizer"]
        j = self.run_json(*args)
        self.assertEqual(j["schema"], "pacer.plan.memory/1")
        g = j["per_gpu"]
        s, b, h, t = 2048, 1, 12288, 8
        self.assertAlmostEqual(g["activation_bytes_per_layer"], 34 * s * b * h / t, delta=1)
        self.assertAlmostEqual(g["optimizer_bytes"], 12 * g["parameters"] / 16, delta=1)
        self.assertAlmostEqual(g["total_bytes"], g["weight_bytes"] + g["gradient_bytes"] + g["optimizer_bytes"] + g["activation_bytes"], delta=1)
        self.assertEqual(pacer("plan", *args, "--gpu-memory", "80GiB").returncode, 0)
        r = pacer("plan", *args[:-4], "--gpu-memory", "40GiB")  # no recomputation, no sequence parallelism
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("FAILED", r.stdout)
        # A fused attention kernel stores no scores, whatever the recomputation: selective's figure plus one
        # fp32 log-sum-exp per row of scores.
        f = self.run_json(*args[:-3], "--distributed-optimizer", "--flash-attention")
        self.assertTrue(f["config"]["flash_attention"])
        names = {t["name"]: t["bytes"] for t in f["layer_activations"]}
        self.assertNotIn("attn.softmax_output", names)
        self.assertAlmostEqual(names["attn.softmax_lse"], 4 * 96 * s * b / t, delta=1)
        self.assertAlmostEqual(f["per_gpu"]["activation_bytes_per_layer"], 34 * s * b * h / t + 4 * 96 * s * b / t, delta=1)
        self.assertIn("fused attention", pacer("plan", *args[:-3], "--flash-attention").stdout)

    def test_impossible_configurations(self):
        self.assert_usage_error(["memory", *GPT175B, "--tp", "7"], "--tp 7 does not divide --heads 96")
        self.assert_usage_error(["memory", *GPT175B, "--pp", "128"], "more stages than --layers")
        self.assert_usage_error(["memory", *GPT175B, "--pp", "7"], "does not divide --layers 96")
        self.assert_usage_error(["memory", *GPT175B, "--dp", "3", "--global-batch", "64"], "does not divide --global-batch 64")
        self.assert_usage_error(["memory", *GPT175B, "--micro-batch", "0"], "--micro-batch 0")
        self.assert_usage_error(["memory", *GPT175B, "--recompute", "some"], "--recompute")
        self.assert_usage_error(["memory", *GPT175B, "--zero", "2", "--distributed-optimizer"], "--distributed-optimizer")
        self.assert_usage_error(["step", *GPT175B, "--tp", "8"], "--gemm-tflops")
        self.assert_usage_error(["step", *GPT175B, "--gemm-tflops", "-5", "--hbm-gbps", "1000"], "--gemm-tflops")
        self.assert_usage_error(["ckpt", "--save-cost", "0s", "--mtbf", "8h"], "--save-cost")
        self.assert_usage_error(["ckpt", "--save-cost", "40s", "--node-mtbf", "100d"], "--nodes")

    def test_comm(self):
        j = self.run_json("comm", *GPT175B, "--tp", "8", "--pp", "8", "--dp", "16", "--global-batch", "1536", *A100)
        self.assertEqual(j["schema"], "pacer.plan.comm/1")
        c = j["per_gpu_per_step"]
        self.assertGreater(c["tp_bytes"], c["dp_bytes"])  # tensor parallelism moves the most, over NVLink
        self.assertAlmostEqual(c["dp_hide_flops"], c["dp_time_s"] * 250e12, delta=1e3)
        self.assertEqual(j["hardware_sources"]["dp_gbps"], "command line")

    def test_step_and_vet_calibration(self):
        base = ["step", *GPT175B, "--tp", "8", "--pp", "8", "--global-batch", "64", "--interleave", "3",
                "--sequence-parallel", "--recompute", "selective"]
        j = self.run_json(*base, *A100)
        self.assertEqual(j["schema"], "pacer.plan.step/1")
        self.assertAlmostEqual(sum(j["breakdown_s"].values()), j["step_s"], places=9)
        self.assertAlmostEqual(j["mfu"], j["model_flops"] / j["step_s"] / 64 / 312e12, places=9)
        # The same figures from a vet report instead of the command line.
        # A cluster report (pacer vet --cluster --json): each node's checks, the slowest node's figure
        # used, and the all-reduce across nodes (NCCL's when it ran) as the network figure.
        node = lambda gemm: {"report": {"checks": [
            {"name": "gpu.gemm_bf16", "target": "gpu0", "value": gemm, "unit": "TFLOP/s", "status": "pass"},
            {"name": "gpu.gemm_bf16", "target": "gpu1", "value": 260, "unit": "TFLOP/s", "status": "pass"},
            {"name": "gpu.hbm_bandwidth", "target": "gpu0", "value": 1631, "unit": "GB/s", "status": "pass"},
            {"name": "gpu.nccl_busbw", "target": "", "value": 230, "unit": "GB/s", "status": "pass"}]}}
        vet = self.write("vet.json", json.dumps({"schema": "pacer.vet.cluster/1", "nodes": [node(250), node(255)],
                                                 "network": {"allreduce": {"status": "pass", "busbw_gbps": 9.0},
                                                             "nccl": {"status": "pass", "busbw_gbps": 22.5}}}))
        # Fused attention: the causal half of the core, at the GEMM rate, no softmax traffic.
        f = self.run_json(*base, *A100, "--flash-attention")
        self.assertLess(f["breakdown_s"]["gemm"], j["breakdown_s"]["gemm"])
        self.assertLess(f["breakdown_s"]["elementwise"], j["breakdown_s"]["elementwise"])
        self.assertEqual(f["model_flops"], j["model_flops"])
        # The kernel's measured rate slows only the core; it needs the fused kernel.
        slow = self.run_json(*base, *A100, "--flash-attention", "--attention-tflops", "100")
        self.assertGreater(slow["breakdown_s"]["gemm"], f["breakdown_s"]["gemm"])
        self.assertEqual(slow["breakdown_s"]["elementwise"], f["breakdown_s"]["elementwise"])
        self.assertEqual(slow["hardware"]["attention_tflops"], 100)
        self.assert_usage_error([*base, *A100, "--attention-tflops", "100"], "--flash-attention")
        k = self.run_json(*base, "--peak-tflops", "312", "--vet", vet)
        self.assertAlmostEqual(k["step_s"], j["step_s"], places=12)
        self.assertIn("gpu.gemm_bf16", k["hardware_sources"]["gemm_tflops"])
        bad = self.write("bad.json", json.dumps({"schema": "something/1"}))
        self.assert_usage_error([*base, "--vet", bad], "schema")

    def test_ckpt(self):
        j = self.run_json("ckpt", "--save-cost", "90s", "--restart-cost", "15m", "--node-mtbf", "1000d", "--nodes", "500",
                          "--campaign", "30d", "--interval", "3h")
        self.assertEqual(j["schema"], "pacer.plan.ckpt/1")
        m = 1000 * 86400 / 500
        self.assertAlmostEqual(j["mtbf_s"], m, places=6)
        self.assertAlmostEqual(j["young_interval_s"], math.sqrt(2 * 90 * m), places=6)
        t = j["daly_interval_s"]
        self.assertAlmostEqual(j["lost_fraction"], 90 / t + (t / 2 + 900) / m, places=12)
        self.assertAlmostEqual(j["expected_failures"], 30 * 86400 / m, places=9)
        self.assertAlmostEqual(j["p_any_failure"], 1 - math.exp(-30 * 86400 / m), places=12)
        # The save cost from a checkpoint size and the write rate vet measured.
        vet = self.write("vet.json", json.dumps({"schema": "pacer.vet/1", "checks": [
            {"name": "storage.write", "target": "/scratch", "value": 2000, "unit": "MB/s", "status": "pass"}]}))
        k = self.run_json("ckpt", "--ckpt-size", "2TB", "--nodes", "10", "--vet", vet, "--mtbf", "24h")
        self.assertAlmostEqual(k["save_cost_s"], 2e12 / (2000e6 * 10), places=9)
        r = pacer("plan", "ckpt", "--save-cost", "90s", "--mtbf", "24h", "--campaign", "30d")
        self.assertIn("chance of at least one", r.stdout)
        # A save that blocks briefly but writes for long: never start the next before the last is durable.
        w = self.run_json("ckpt", "--save-cost", "0.02s", "--mtbf", "10m", "--write-time", "15s")
        self.assertLess(w["daly_interval_s"], 15)
        self.assertEqual((w["interval_s"], w["write_time_s"]), (15, 15))
        self.assertAlmostEqual(w["lost_fraction"], 0.02 / 15 + 7.5 / 600, places=12)
        r = pacer("plan", "ckpt", "--save-cost", "0.02s", "--mtbf", "10m", "--write-time", "15s")
        self.assertIn("the write time", r.stdout)
        self.assertEqual(self.run_json("ckpt", "--save-cost", "40s", "--mtbf", "8h", "--write-time", "5s")["interval_s"],
                         self.run_json("ckpt", "--save-cost", "40s", "--mtbf", "8h")["daly_interval_s"])
        self.assert_usage_error(["ckpt", "--save-cost", "1s", "--mtbf", "1h", "--write-time", "soon"], "--write-time")


    def test_units_presets_and_overrides(self):
        # A bare number where a size is needed is refused with the accepted forms, not read as bytes.
        self.assert_usage_error(["memory", "--model", "llama3-8b", "--gpu-memory", "141"], "a unit is needed")
        r = pacer("plan", "memory", "--model", "llama3-8b", "--gpu-memory", "141GB")
        self.assertEqual(r.returncode, 1, r.stderr)  # 18 bytes a parameter for 8B parameters do not fit on one GPU
        self.assertIn("of 131 GiB per GPU", r.stdout)
        self.assert_usage_error(["memory", "--model", "llama3-9b"], "llama3-70b")  # unknown preset: the names
        self.assert_usage_error(["step", "--model", "llama3-8b", "--gpu", "h300"], "b200")
        self.assert_usage_error(["memory", "--layers", "4"], "--model NAME")
        self.assert_usage_error(["step", "--model", "llama3-8b", "--gpu", "h200", "--hbm-gbps", "4.8TB"], "unknown unit")
        j = self.run_json("memory", "--model", "llama3-70b")
        self.assertAlmostEqual(j["config"]["parameters"] / 70.6e9, 1, delta=0.005)
        self.assertEqual((j["config"]["kv_heads"], j["config"]["mlp"], j["config"]["embeddings"]), (8, "swiglu", "untied"))
        # Flag by flag over the preset.
        o = self.run_json("memory", "--model", "llama3-70b", "--kv-heads", "64", "--embeddings", "tied")
        self.assertEqual(o["config"]["kv_heads"], 64)
        self.assertGreater(o["config"]["parameters"], j["config"]["parameters"])
        # Rates take units; bits are divided by 8; the preset, the command line and the report are named.
        a = self.run_json("step", "--model", "llama3-8b", "--gpu", "h200", "--tp", "8", "--sequence-parallel",
                          "--flash-attention", "--dp-gbps", "400Gb/s", "--gemm-tflops", "0.7PFLOPs")
        self.assertAlmostEqual(a["hardware"]["dp_gbps"], 50)
        self.assertAlmostEqual(a["hardware"]["gemm_tflops"], 700)
        self.assertEqual(a["hardware_sources"]["gemm_tflops"], "command line")
        self.assertEqual(a["hardware_sources"]["hbm_gbps"], "preset h200")
        vet = self.write("vet.json", json.dumps({"schema": "pacer.vet/1", "checks": [
            {"name": "gpu.gemm_bf16", "status": "pass", "value": 650.0, "unit": "TFLOP/s"}]}))
        v = self.run_json("step", "--model", "llama3-8b", "--gpu", "h200", "--from-vet", vet)
        self.assertAlmostEqual(v["hardware"]["gemm_tflops"], 650)
        self.assertIn("gpu.gemm_bf16", v["hardware_sources"]["gemm_tflops"])

    def test_bad_model_input(self):
        m = ["memory", "--model", "llama3-70b"]
        self.assert_usage_error([*m, "--kv-heads", "6"], "--kv-heads 6 does not divide --heads 64")
        self.assert_usage_error([*m, "--heads", "60"], "--heads 60 does not divide --hidden 8192")
        self.assert_usage_error([*m, "--tp", "128"], "--tp 128 is larger than --heads 64")
        self.assert_usage_error(["memory", "--model", "mixtral-8x7b", "--ep", "3", "--dp", "3"], "not divisible by --ep 3")
        self.assert_usage_error([*m, "--cp", "2"], "--cp needs --flash-attention")
        self.assert_usage_error([*m, "--mlp", "relu"], "--mlp")
        # The search refuses the same models, before enumerating anything.
        s = ["search", "--model", "llama3-70b", "--gpu", "h100-sxm", "--gpus", "64", "--global-batch", "128"]
        self.assert_usage_error([*s, "--kv-heads", "6"], "--kv-heads 6 does not divide --heads 64")
        self.assert_usage_error([*s, "--heads", "60"], "--heads 60 does not divide --hidden 8192")
        self.assert_usage_error(["search", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "64",
                                 "--global-batch", "128", "--ep", "3"], "not divisible by --ep 3")
        self.assert_usage_error(["search", "--model", "llama3-70b", "--gpu", "h300", "--gpus", "64", "--global-batch", "128"],
                                "h100-sxm")  # an unknown GPU preset: the names

    def test_moe_and_context_parallel(self):
        j = self.run_json("comm", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--tp", "2", "--ep", "8", "--dp", "8",
                          "--sequence-parallel")
        self.assertGreater(j["per_gpu_per_step"]["ep_bytes"], 0)
        self.assertEqual(j["config"]["experts"], 8)
        self.assertAlmostEqual(j["config"]["active_parameters"] / 12.9e9, 1, delta=0.01)
        r = pacer("plan", "step", "--model", "llama3-8b", "--gpu", "h200", "--cp", "16", "--flash-attention", "--seq", "131072")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("context-parallel comm", r.stdout)
        # The Llama 3 way: K and V all-gathered before the attention, on the critical path, and kept for backward.
        cp = ["--model", "llama3-405b", "--gpu", "h100-sxm", "--tp", "8", "--pp", "16", "--cp", "16", "--dp", "8",
              "--interleave", "4", "--uneven-stages", "--sequence-parallel", "--flash-attention", "--seq", "131072",
              "--global-batch", "128", "--distributed-optimizer"]
        ring = self.run_json("step", *cp)
        ag = self.run_json("step", *cp, "--cp-comm", "allgather")
        self.assertEqual((ring["config"]["cp_comm"], ag["config"]["cp_comm"]), ("ring", "allgather"))
        self.assertEqual(ring["breakdown_s"]["cp_comm"], 0)
        self.assertGreater(ag["breakdown_s"]["cp_comm"], 0)
        self.assertGreater(ag["step_s"], ring["step_s"])
        no_gpu = [a for a in cp if a not in ("--gpu", "h100-sxm")]
        mem = {c: self.run_json("memory", *no_gpu, "--cp-comm", c) for c in ("ring", "allgather")}
        self.assertGreater(mem["allgather"]["per_gpu"]["activation_bytes"], mem["ring"]["per_gpu"]["activation_bytes"])
        self.assertIn("attn.kv_gathered", [t["name"] for t in mem["allgather"]["layer_activations"]])
        r = pacer("plan", "comm", *cp, "--cp-comm", "allgather")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("all-gather of keys and values", r.stdout)
        self.assert_usage_error(["step", *cp, "--cp-comm", "ulysses"], "--cp-comm 'ulysses': expected ring or allgather")

    def test_tensor_parallel_overlap(self):
        args = ["step", "--model", "llama3-70b", "--gpu", "h100-sxm", "--tp", "4", "--pp", "4", "--cp", "2", "--dp", "2",
                "--interleave", "5", "--global-batch", "128", "--sequence-parallel", "--flash-attention",
                "--distributed-optimizer"]
        exposed = self.run_json(*args)
        overlapped = self.run_json(*args, "--tp-overlap")
        self.assertTrue(overlapped["config"]["tp_overlap"])
        self.assertFalse(exposed["config"]["tp_overlap"])
        self.assertLess(overlapped["breakdown_s"]["tp_comm"], exposed["breakdown_s"]["tp_comm"])
        self.assertGreater(overlapped["breakdown_s"]["tp_comm"], 0)
        self.assertLess(overlapped["step_s"], exposed["step_s"])
        no_sp = [a for a in args if a != "--sequence-parallel"]
        self.assert_usage_error([*no_sp, "--tp-overlap"], "--tp-overlap needs --sequence-parallel")

    def test_attention_kernel(self):
        # NeMo's GPT-3 175B and Nemotron-4 340B recipes set NVTE_FUSED_ATTN=0: Transformer Engine then runs
        # FlashAttention-2, slower on Hopper than cuDNN's kernel, and only the attention core pays for it.
        args = ["step", "--model", "nemotron4-340b", "--gpu", "h100-sxm", "--tp", "8", "--pp", "8", "--dp", "2",
                "--interleave", "12", "--global-batch", "32", "--sequence-parallel", "--flash-attention"]
        cudnn = self.run_json(*args)
        flash2 = self.run_json(*args, "--attention-kernel", "flash2")
        self.assertLess(flash2["hardware"]["attention_tflops"], cudnn["hardware"]["attention_tflops"])
        self.assertIn("FlashAttention-2", flash2["hardware_sources"]["attention_tflops"])
        self.assertGreater(flash2["breakdown_s"]["gemm"], cudnn["breakdown_s"]["gemm"])
        self.assertEqual(flash2["breakdown_s"]["elementwise"], cudnn["breakdown_s"]["elementwise"])
        self.assertEqual(flash2["model_flops"], cudnn["model_flops"])
        # A measured rate on the command line wins over the preset's.
        given = self.run_json(*args, "--attention-kernel", "flash2", "--attention-tflops", "300")
        self.assertEqual(given["hardware"]["attention_tflops"], 300)
        self.assert_usage_error([*args, "--attention-kernel", "xformers"], "expected cudnn or flash2")
        no_fused = [a for a in args if a != "--flash-attention"]
        self.assert_usage_error([*no_fused, "--attention-kernel", "flash2"], "--flash-attention")
        # Measured on Hopper only: elsewhere the rate must be given.
        self.assert_usage_error([*args[:4], "a100-80g", *args[5:], "--attention-kernel", "flash2"], "--attention-tflops")

    def test_search(self):
        args = ["search", "--model", "llama3-70b", "--gpu", "h200", "--gpus", "4096", "--global-batch", "2048", "--seq", "4096"]
        j = self.run_json(*args, "--top", "3")
        self.assertEqual(j["schema"], "pacer.plan.search/1")
        self.assertEqual(len(j["top"]), 3)
        steps = [t["step_s"] for t in j["top"]]
        self.assertEqual(steps, sorted(steps))
        for t in j["top"]:
            c = t["config"]
            self.assertEqual(c["tp"] * c["pp"] * c["cp"] * c["dp"], 4096)
            self.assertLessEqual(t["memory_bytes"], 0.9 * 141e9)
        r = pacer("plan", *args)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("OK:", r.stdout)
        self.assertIn("WHY SLOWER", r.stdout)
        # Fixing a dimension keeps it fixed.
        f = self.run_json(*args, "--tp", "8", "--recompute", "full")
        self.assertTrue(all(t["config"]["tp"] == 8 and t["config"]["recompute"] == "full" for t in f["top"]))
        # Nothing fits: exit 1 with the smallest need.
        r = pacer("plan", "search", "--model", "llama3-405b", "--gpu", "a100-80g", "--gpus", "8", "--global-batch", "8")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("FAILED", r.stdout)
        self.assert_usage_error([*args, "--dp", "8"], "--dp")
        self.assert_usage_error([*args, "--memory-margin", "120%"], "--memory-margin")


if __name__ == "__main__":
    unittest.main()
