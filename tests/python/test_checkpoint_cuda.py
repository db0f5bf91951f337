"""CUDA tensors through pacer.Checkpointer (skipped without a CUDA device for torch).

    PYTHONPATH=BUILD/python /usr/bin/python3 -m unittest -v test_checkpoint_cuda
"""
import os
import tempfile
import time
import unittest

import pacer

try:
    import torch
except ImportError:
    torch = None


@unittest.skipIf(torch is None or not torch.cuda.is_available(), "no CUDA device for torch")
class Cuda(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pacer-cuda-")
        # Small chunks: the loads go through the pinned buffers in many pieces.
        self.ck = pacer.Checkpointer(os.path.join(self.tmp.name, "ckpt"), keep_last=0, chunk_bytes=64 << 10)

    def tearDown(self):
        del self.ck
        self.tmp.cleanup()

    def state(self, device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 64, device=device)).square().mean().backward()
            opt.step()
        big = torch.randn(1000, 1000, device=device).to(torch.bfloat16)
        return model, opt, {"model": model.state_dict(), "optim": opt.state_dict(), "big": big,
                            "rng": pacer.rng_state()}

    def test_save_cuda_tensors_then_overwrite_them_at_once(self):
        model, opt, state = self.state("cuda")
        want = {k: v.detach().cpu().clone() for k, v in state["model"].items()}
        big = state["big"].cpu()
        h = self.ck.save(1, state)
        # save() returned: the bytes were copied; the next optimizer step may change them.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            state["big"].zero_()
        h.wait()
        _, got, _ = self.ck.load(map_location="cuda")
        for k, v in want.items():
            self.assertEqual(got["model"][k].device.type, "cuda")
            self.assertTrue(torch.equal(got["model"][k].cpu(), v), k)
        self.assertTrue(torch.equal(got["big"].cpu(), big))

    def test_save_before_the_optimizer_defers_the_copies_and_orders_its_step(self):
        # 256 MiB of weights: their copies take long enough that an optimizer step
        # not ordered after them would change bytes still being copied.
        ck = pacer.Checkpointer(os.path.join(self.tmp.name, "defer"), keep_last=0, staging_bytes=2 << 30)
        torch.manual_seed(0)
        w = [torch.nn.Parameter(torch.randn(4096, 4096, device="cuda")) for _ in range(4)]
        opt = torch.optim.SGD(w, lr=1.0)
        for p in w:
            p.grad = torch.ones_like(p)
        want = [p.detach().cpu().clone() for p in w]
        h = ck.save(1, {"w": w, "optim": opt.state_dict()}, before=opt)
        deferred = not h.copied()
        opt.step()  # ordered after the copies on the GPU: saved bytes are the ones before this step
        h.wait()
        self.assertTrue(h.copied())
        _, got, _ = ck.load()
        for a, b in zip(got["w"], want):
            self.assertTrue(torch.equal(a, b))
        self.assertFalse(torch.equal(w[0].detach().cpu(), want[0]))  # the step did run
        # No defer on a second save without `before`: copied when save() returns.
        self.assertTrue(ck.save(2, {"w": w}).copied())
        print(f"deferred copies in flight after save(): {deferred}")
        del ck

    def test_overflow_takes_cuda_tensors_beyond_the_pinned_pool(self):
        # A pinned pool of two 64 KiB buffers and 2 MB of CUDA tensors: the
        # rest goes to the (pageable) overflow, the caller may change the
        # tensors once save() returns, and nothing waited for the writer.
        ck = pacer.Checkpointer(os.path.join(self.tmp.name, "overflow"), keep_last=0, chunk_bytes=64 << 10,
                                staging_bytes=128 << 10, overflow_bytes=4 << 20)
        x = torch.randn(1000, 500, device="cuda")
        want = x.cpu()
        h = ck.save(1, {"x": x})
        x.zero_()
        h.wait()
        s = ck.stats()
        self.assertEqual(s["pool_waits"], 0, s)
        self.assertGreater(s["overflow_bytes"], 0, s)
        self.assertTrue(torch.equal(ck.load(1).state["x"], want))

    def test_reserve_pins_the_pool_before_the_first_save(self):
        ck = pacer.Checkpointer(os.path.join(self.tmp.name, "reserve"), keep_last=0, chunk_bytes=1 << 20,
                                staging_bytes=64 << 20)
        x = torch.randn(1000, 1000, device="cuda")
        ck.reserve(x.device)
        deadline = time.monotonic() + 60
        while ck.stats()["pinned_bytes"] < 64 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        s = ck.stats()
        self.assertEqual((s["staging_bytes"], s["pinned_bytes"]), (64 << 20, 64 << 20), s)
        want = x.cpu()
        h = ck.save(1, {"x": x})
        x.zero_()
        h.wait()
        s = ck.stats()
        self.assertEqual((s["staging_bytes"], s["pool_waits"]), (64 << 20, 0), s)
        self.assertTrue(torch.equal(ck.load(1).state["x"], want))

    def test_cpu_checkpoint_loads_onto_the_gpu_and_into_gpu_tensors(self):
        _, _, state = self.state("cpu")
        self.ck.save(1, state).wait()
        _, got, _ = self.ck.load(map_location="cuda:0")
        self.assertEqual(got["big"].device, torch.device("cuda", 0))
        self.assertTrue(torch.equal(got["big"].cpu(), state["big"]))
        model, opt, target = self.state("cuda")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        weight = model[0].weight
        self.ck.load(into=target)
        self.assertIs(model[0].weight, weight)
        self.assertEqual(weight.device.type, "cuda")
        self.assertTrue(torch.equal(weight.cpu(), state["model"]["0.weight"]))
        opt.load_state_dict(target["optim"])
        self.assertEqual(opt.state[weight]["exp_avg"].device.type, "cuda")
        pacer.set_rng_state(target["rng"])


if __name__ == "__main__":
    unittest.main()
