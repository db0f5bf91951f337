"""A launcher for `pacer run --nodes` tests without Slurm: one process per node on this machine.

    pacer run --nodes 2 --node-list a,b,c --launcher "python3 fake_launcher.py" --leader-addr 127.0.0.1 -- CMD

Runs the command after it once per node of $PACER_RUN_NODES (the chosen
nodes, comma-separated), each with PACER_NODE_NAME set to that node, as srun
runs one task per node. A node listed in $FAKE_DOWN_FILE (one name a line) is
unreachable: its process is not started and the launcher exits 255 for it, as
srun does for a node that does not answer. SIGTERM is passed to every child;
the exit status is the highest of the children's.
"""
import os
import signal
import subprocess
import sys


def down_nodes():
    path = os.environ.get("FAKE_DOWN_FILE", "")
    if not path or not os.path.exists(path):
        return set()
    with open(path) as f:
        return {line.strip() for line in f if line.strip()}


def main():
    nodes = [n for n in os.environ.get("PACER_RUN_NODES", "").split(",") if n]
    cmd = sys.argv[1:]
    if not nodes or not cmd:
        sys.exit("fake_launcher: PACER_RUN_NODES and a command are needed")
    down = down_nodes()
    kids = [subprocess.Popen(cmd, env=dict(os.environ, PACER_NODE_NAME=n)) for n in nodes if n not in down]
    signal.signal(signal.SIGTERM, lambda *_: [k.send_signal(signal.SIGTERM) for k in kids])
    codes = [k.wait() for k in kids]
    codes = [c if c >= 0 else 128 - c for c in codes] + ([255] if any(n in down for n in nodes) else [])
    sys.exit(max(codes, default=0))


if __name__ == "__main__":
    main()
