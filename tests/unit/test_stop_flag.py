"""The stop flag (rft/runtime/preemption.py): SIGUSR2 and SIGTERM only raise it, SIGTERM also marks
that Slurm ends the job itself; the processes a rank starts after `install()` live through a
SIGTERM (Slurm signals every process of a task, and vLLM's engine process installs a handler that
shuts it down: vllm/v1/engine/core.py); while a requeue is under way SIGTERM ends the rank at once.
Each case runs in a process of its own: `install()` blocks SIGTERM in the thread that calls it."""

import json
import os
import subprocess
import sys
import textwrap

from tests.e2e.helpers import REPO


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "case.py"  # a file, not -c: multiprocessing's spawn imports the main module again
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})


def test_usr2_asks_for_a_requeue_and_sigterm_for_a_stop(tmp_path):
    result = _run("""
        import json, os, signal, time
        from rft.runtime.preemption import StopFlag
        flag = StopFlag(); flag.install()
        flag.ignore_in_children(); flag.install()  # as around vLLM's start: installed twice
        seen = []
        os.kill(os.getpid(), signal.SIGUSR2); time.sleep(0.2)
        seen.append([flag.requested, flag.terminated])
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 10
        while not flag.terminated and time.time() < deadline:
            time.sleep(0.05)
        seen.append([flag.requested, flag.terminated])
        print(json.dumps(seen))
        """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [[True, False], [True, True]]


def test_a_process_started_after_install_lives_through_sigterm_until_interrupted(tmp_path):
    """The child sets the handler vLLM's engine core sets (exit on SIGTERM or SIGINT); started by
    multiprocessing's spawn as vLLM starts it, and by subprocess as reward and tool processes are."""
    result = _run("""
        import json, multiprocessing, os, signal, subprocess, sys, time
        from rft.runtime.preemption import StopFlag

        CHILD = "import signal, sys, time\\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\\n" \\
                "signal.signal(signal.SIGINT, lambda *_: sys.exit(8))\\nprint('up', flush=True)\\ntime.sleep(60)"

        def engine_core(ready):
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
            signal.signal(signal.SIGINT, lambda *_: sys.exit(8))
            ready.set()
            time.sleep(60)

        if __name__ == "__main__":
            flag = StopFlag(); flag.install()
            spawn = multiprocessing.get_context("spawn")
            ready = spawn.Event()
            core = spawn.Process(target=engine_core, args=(ready,)); core.start(); ready.wait(60)
            tool = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
            tool.stdout.readline()
            for pid in (core.pid, tool.pid, os.getpid()):  # as Slurm signals every process of the task
                os.kill(pid, signal.SIGTERM)
            time.sleep(1.0)
            alive = [core.is_alive(), tool.poll() is None, flag.terminated]
            os.kill(core.pid, signal.SIGINT); tool.send_signal(signal.SIGINT)
            core.join(30)
            print(json.dumps({"after_sigterm": alive, "exit_codes": [core.exitcode, tool.wait(30)]}))
        """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"after_sigterm": [True, True, True], "exit_codes": [8, 8]}


def test_sigterm_while_awaiting_requeue_exits_at_once(tmp_path):
    result = _run("""
        import os, signal, time
        from rft.runtime.preemption import StopFlag
        f = StopFlag(); f.install()
        f.awaiting_requeue = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise SystemExit(3)
        """, tmp_path)
    assert result.returncode == 0, result.stderr
