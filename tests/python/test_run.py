"""Tests of pacer.run: the checkpoint request contract helpers and the port lease.

Run with the python the module was built for:
    PYTHONPATH=BUILD/python /usr/bin/python3 -m unittest -v test_run
"""
import os
import signal
import socket
import tempfile
import unittest
from unittest import mock

import pacer
import pacer.run


def bind(port):
    s = socket.socket()
    try:
        s.bind(("", port))
        return s
    except OSError:
        s.close()
        return None


class ContractTest(unittest.TestCase):
    def setUp(self):
        pacer.run._signalled.clear()  # a request signal of an earlier test

    def test_request_file(self):
        with tempfile.TemporaryDirectory() as d:
            req = os.path.join(d, "req")
            env = {"PACER_CKPT_REQUEST_FILE": req, "PACER_CKPT_DIR": d, "PACER_RUN_ATTEMPT": "2"}
            with mock.patch.dict(os.environ, env):
                self.assertTrue(pacer.run.supervised())
                self.assertFalse(pacer.run.checkpoint_requested())
                open(req, "w").close()
                self.assertTrue(pacer.run.checkpoint_requested())
                self.assertEqual(pacer.run.ckpt_dir("/elsewhere"), d)
                self.assertEqual(pacer.run.attempt(), 2)
        with mock.patch.dict(os.environ, {}, clear=True):
            self.assertFalse(pacer.run.supervised())
            self.assertFalse(pacer.run.checkpoint_requested())
            self.assertEqual(pacer.run.ckpt_dir("/elsewhere"), "/elsewhere")

    def test_planted_request_file_does_not_count(self):
        # Only a regular file of this user, as `pacer run` creates it, is a request.
        with tempfile.TemporaryDirectory() as d:
            real = os.path.join(d, "real")
            open(real, "w").close()
            link = os.path.join(d, "req")
            os.symlink(real, link)
            with mock.patch.dict(os.environ, {"PACER_CKPT_REQUEST_FILE": link}):
                self.assertFalse(pacer.run.checkpoint_requested())
            os.unlink(link)
            os.mkdir(link)
            with mock.patch.dict(os.environ, {"PACER_CKPT_REQUEST_FILE": link}):
                self.assertFalse(pacer.run.checkpoint_requested())
            if os.geteuid() == 0:  # root can make a file of another user
                os.chown(real, 65534, 65534)
                with mock.patch.dict(os.environ, {"PACER_CKPT_REQUEST_FILE": real}):
                    self.assertFalse(pacer.run.checkpoint_requested())

    def test_request_signal(self):
        with mock.patch.dict(os.environ, {"PACER_CKPT_SIGNAL": "USR2", "PACER_CKPT_REQUEST_FILE": "/nonexistent/req"}):
            self.assertEqual(pacer.run.watch(), signal.SIGUSR2)
            self.assertFalse(pacer.run.checkpoint_requested())
            os.kill(os.getpid(), signal.SIGUSR2)  # would end the process without the handler
            self.assertTrue(pacer.run.checkpoint_requested())


class PortsTest(unittest.TestCase):
    def test_lease_holds_until_handed_over(self):
        lease = pacer.run.ports(2, job=31337, local_rank=1)
        a, b = lease.ports
        self.assertEqual(b, a + 1)
        self.assertIsNone(bind(a))  # held
        lease.release(a)
        s = bind(a)
        self.assertIsNotNone(s)
        s.close()
        fd = lease.take_fd(b)
        self.assertGreaterEqual(fd, 0)
        srv = socket.socket(fileno=fd)
        srv.listen(1)
        self.assertEqual(srv.getsockname()[1], b)
        srv.close()

    def test_exhausted_range_raises(self):
        held = pacer.run.ports(4, job=4242, local_rank=0, per_rank=4)
        with self.assertRaises(pacer.Error) as e:
            pacer.run.ports(1, job=4242, local_rank=0, per_rank=4)
        self.assertIn("exhausted", str(e.exception))
        held.release_all()
        self.assertEqual(len(pacer.run.ports(4, job=4242, local_rank=0, per_rank=4).ports), 4)


if __name__ == "__main__":
    unittest.main()
