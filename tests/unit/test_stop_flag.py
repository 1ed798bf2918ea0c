"""SIGUSR2 only raises the stop flag; SIGTERM keeps its previous meaning until the checkpoint is
complete and a requeue is under way (then it ends the process at once)."""

import os
import signal
import subprocess
import sys

from rft.runtime.preemption import StopFlag


def test_usr2_sets_the_flag_and_sigterm_goes_to_the_previous_handler():
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda *_: calls.append("previous"))
    try:
        flag = StopFlag()
        flag.install()
        flag.ignore_in_children()  # as around vLLM's start
        flag.install()  # installing again must not make the handler call itself
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == ["previous"] and not flag.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.requested
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_sigterm_while_awaiting_requeue_exits_at_once():
    code = ("import os, signal, time\nfrom rft.runtime.preemption import StopFlag\nf = StopFlag(); f.install()\n"
            "f.awaiting_requeue = True\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(5)\nraise SystemExit(3)\n")
    result = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 0
