"""A task for tests/unit/test_rank_server.py, run as `python -m tests.unit.rank_server_task ACTION FILE`:
it writes what it sees (argv, cwd, an environment variable, its parent, whether rft was already
imported) to FILE as JSON, then does ACTION."""

import json
import os
import signal
import sys
import time

if __name__ == "__main__":
    action, report = sys.argv[1], sys.argv[2]
    if action == "wait_usr2":  # before the report, which tells the test it may signal
        signal.signal(signal.SIGUSR2, lambda *_: sys.exit(0))
    seen = {"argv": sys.argv[1:], "cwd": os.getcwd(), "marker": os.environ.get("RANK_SERVER_TEST"),
            "pid": os.getpid(), "ppid": os.getppid(), "rft_loaded": "rft.registry" in sys.modules,
            "cmdline": open("/proc/self/cmdline").read().replace("\0", " ")}
    with open(report + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(report + ".tmp", report)
    print("out line", flush=True)
    print("err line", file=sys.stderr, flush=True)
    if action == "exit3":
        sys.exit(3)
    if action == "terminate_self":
        os.kill(os.getpid(), signal.SIGTERM)
    if action == "wait_usr2":
        time.sleep(120)
        sys.exit(9)
    if action == "sleep":
        time.sleep(120)
