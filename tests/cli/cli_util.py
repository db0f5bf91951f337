"""Shared by the CLI integration tests: the binary under test and small file helpers."""
import os
import subprocess

PACER = os.environ.get("PACER_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin/pacer"))


def pacer(*args, timeout=120):
    """Runs the real pacer binary; returns the CompletedProcess (text mode)."""
    return subprocess.run([PACER, *args], capture_output=True, text=True, timeout=timeout)


def flip_byte(path, offset):
    """Inverts one byte in place: the smallest corruption a checksum must catch."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
