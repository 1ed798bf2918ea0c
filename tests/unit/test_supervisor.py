"""A rank runs in a supervised child (rft/runtime/supervisor.py): its result and its exceptions come
back as if it had run in place, and a kill by a signal becomes a message that names the signal,
the peak memory and, where the kernel counted one, the OOM killer. Real forks and real signals."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rft.launch.job_state import process_running as alive
from rft.runtime.supervisor import RankKilledError, death_message, run_supervised


def test_result_comes_back():
    assert run_supervised(lambda: {"steps": 3, "pid": os.getpid()}, "trainer rank 0")["steps"] == 3
    assert run_supervised(lambda: os.getpid(), "trainer rank 0") != os.getpid()  # it ran in a child


def test_exception_comes_back_with_its_type_and_the_childs_traceback():
    def fails():
        raise ValueError("taskset x.jsonl has no valid rows")

    with pytest.raises(ValueError, match="no valid rows") as err:
        run_supervised(fails, "trainer rank 0")
    assert any("in the rank's process" in note and "fails" in note for note in err.value.__notes__)


def test_exception_that_cannot_be_rebuilt_arrives_as_its_traceback():
    class TwoArgs(Exception):
        def __init__(self, a, b):  # pickles, but unpickling calls TwoArgs(msg): TypeError
            super().__init__(f"{a}/{b}")

    def fails():
        raise TwoArgs("a", "b")

    with pytest.raises(RuntimeError, match=r"trainer rank 0 failed:(.|\n)*TwoArgs: a/b"):
        run_supervised(fails, "trainer rank 0")


def test_sigkill_is_reported_with_signal_and_memory():
    def killed():
        ballast = bytearray(200 * 2**20)  # ~200 MiB resident, visible in the peak
        ballast[::4096] = b"x" * len(ballast[::4096])
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(RankKilledError) as err:
        run_supervised(killed, "rollout rank 1")
    message = str(err.value)
    assert message.startswith("rollout rank 1 was killed by SIGKILL (signal 9")
    peak = float(message.split("peaked at ")[1].split(" GiB")[0])
    assert peak >= 0.2, message
    assert "OOM killer" in message and "trainer.micro_batch_size" in message  # what to do if memory ran out


def test_other_signals_and_exits_are_named():
    with pytest.raises(RankKilledError, match=r"trainer rank 0 was killed by SIGTERM \(signal 15"):
        run_supervised(lambda: os.kill(os.getpid(), signal.SIGTERM), "trainer rank 0")
    with pytest.raises(RankKilledError, match="exited with code 3 without a result"):
        run_supervised(lambda: os._exit(3), "trainer rank 0")


def test_oom_kill_counted_by_the_cgroup_is_named_as_such():
    status = signal.SIGKILL  # a wait status of "killed by signal 9"
    assert "the kernel's OOM killer (SIGKILL" in death_message("trainer rank 0", status, 22.8, 0, 1)
    assert "by `kill -9`, by Slurm, or by the kernel's OOM killer" in death_message("trainer rank 0", status, 1.0, 0, 0)
    assert "OOM killer" in death_message("trainer rank 0", status, 1.0, None, None)  # cannot tell: all causes named


def test_signals_reach_the_child(tmp_path):
    """SIGUSR2 (Slurm's time-limit warning, or submitit's local controller) sent to the task process
    reaches the rank, whose handler sees it. The signal is sent once the rank says its handler is
    in place (a file), not a second after the start, which a fork on a loaded machine can outlast."""
    ready = tmp_path / "handler-installed"

    def waits_for_usr2():
        seen = []
        signal.signal(signal.SIGUSR2, lambda *_: seen.append(1))
        ready.touch()
        deadline = time.time() + 60  # only bounds a hang
        while not seen and time.time() < deadline:
            time.sleep(0.01)
        return bool(seen)

    parent = os.getpid()
    sender = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, time
        deadline = time.time() + 60
        while not os.path.exists({str(ready)!r}) and time.time() < deadline:
            time.sleep(0.01)
        os.kill({parent}, signal.SIGUSR2)
    """)])
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        assert run_supervised(waits_for_usr2, "trainer rank 0") is True
    finally:
        signal.signal(signal.SIGUSR2, previous)
        sender.wait()


def test_child_dies_with_its_supervisor(tmp_path):
    """A task process killed outright (a cancelled job) takes its rank with it: no orphan."""
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import os, time
        from rft.runtime.supervisor import run_supervised
        def work():
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            time.sleep(60)
        run_supervised(work, "trainer rank 0")
    """)
    task = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.time() < deadline and task.poll() is None
            time.sleep(0.05)
        child = int(pid_file.read_text())
        task.kill()
        task.wait()
        deadline = time.time() + 10
        while alive(child):
            assert time.time() < deadline, "the rank outlived its supervisor"
            time.sleep(0.05)
    finally:
        task.kill()


def test_what_a_killed_rank_started_goes_with_it(tmp_path):
    """A rank killed by -9 leaves no process behind (vLLM's engine process lived on, holding a
    GiB and spinning on the cores, before the rank led a process group of its own)."""
    pid_file = tmp_path / "grandchild.pid"

    def rank_with_a_helper():
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        pid_file.write_text(str(helper.pid))
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(RankKilledError):
        run_supervised(rank_with_a_helper, "rollout rank 1")
    helper = int(pid_file.read_text())
    deadline = time.time() + 10
    while alive(helper):
        assert time.time() < deadline, "the killed rank's subprocess outlived it"
        time.sleep(0.05)

