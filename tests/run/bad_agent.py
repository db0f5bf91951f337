"""A misbehaving agent for `pacer run --nodes` tests, used as the launcher.

    pacer run --nodes 1 --launcher "python3 bad_agent.py" ... -- CMD

It first connects with a wrong token, then as the real agent of the first
node of $PACER_RUN_NODES (the token from $PACER_RUN_TOKEN) and, once
started, sends a progress report whose rank is not a number, then waits for
the leader to close the connection.
"""
import json
import os
import socket
import sys


def connect(leader):
    host, port = leader.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def main():
    argv = sys.argv[1:]
    leader = argv[argv.index("--leader") + 1]
    attempt = int(argv[argv.index("--attempt") + 1])
    node = os.environ["PACER_RUN_NODES"].split(",")[0]
    stray = connect(leader)
    stray.sendall(json.dumps({"type": "hello", "schema": "pacer.run.agent/1", "node": node, "attempt": attempt,
                              "token": "not-the-token", "pid": os.getpid()}).encode() + b"\n")
    stray.recv(65536)  # the refusal
    s = connect(leader)
    s.sendall(json.dumps({"type": "hello", "schema": "pacer.run.agent/1", "node": node, "attempt": attempt,
                          "token": os.environ["PACER_RUN_TOKEN"], "pid": os.getpid()}).encode() + b"\n")
    f = s.makefile("rb")
    start = json.loads(f.readline())
    assert start["type"] == "start", start
    s.sendall(b'{"type": "progress", "ranks": [{"rank": "x", "local_rank": 0, "pid": 1, "idle_s": 0}]}\n')
    while f.readline():
        pass
    sys.exit(3)


if __name__ == "__main__":
    main()
