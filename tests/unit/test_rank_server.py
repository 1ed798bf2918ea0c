"""The rank server (rft/runtime/rank_server.py) runs a task as the interpreter it stands in for
would: the client's fds, environment, cwd and arguments; its exit code or signal; signals
forwarded; a killed client takes its task along; no server: a plain interpreter. The server here
preloads only `json` (the launcher's preloads torch and vLLM: seconds the behaviour does not need)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from rft.runtime import rank_server
from tests.e2e.helpers import process_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK = ["-u", "-m", "tests.unit.rank_server_task"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("srv") / "ranks.sock")
    pid = rank_server.ensure_server(path, 120, preload=("json",))
    assert pid is not None
    assert rank_server.ensure_server(path, 120, preload=("json",)) is None  # one server per path
    yield path, pid
    assert rank_server.stop_server(path)
    _wait_gone(pid)


def _client(path: str, action: str, report, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rft.runtime.rank_server", "run", path, *TASK, action, str(report)],
                            cwd=REPO, env={**os.environ, "RANK_SERVER_TEST": "seen"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_for_file(path, client: subprocess.Popen) -> dict:
    while not os.path.exists(path):  # the task writes it first thing
        assert client.poll() is None, client.communicate()
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while process_state(pid) not in ("", "Z"):
        assert time.monotonic() < deadline, f"process {pid} is still there after {timeout_s} s"
        time.sleep(0.05)


def test_a_task_runs_with_the_clients_fds_environment_cwd_and_exit_code(server, tmp_path):
    path, server_pid = server
    client = _client(path, "exit3", tmp_path / "seen.json")
    out, err = client.communicate(timeout=60)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert client.returncode == 3
    assert out == "out line\n" and err == "err line\n"
    assert seen["argv"] == ["exit3", str(tmp_path / "seen.json")]
    assert seen["cwd"] == REPO and seen["marker"] == "seen"
    assert seen["ppid"] == server_pid  # forked by the server, not started by the client
    assert not seen["rft_loaded"]  # rft is imported afresh by each task
    # its own command line, by which the launcher finds a job's ranks (rft/launch/job_state.py)
    assert "-m tests.unit.rank_server_task exit3" in seen["cmdline"]


def test_a_task_killed_by_a_signal_ends_its_client_by_the_same_signal(server, tmp_path):
    client = _client(server[0], "terminate_self", tmp_path / "seen.json")
    client.communicate(timeout=60)
    assert client.returncode == -signal.SIGTERM


def test_signals_sent_to_the_client_reach_the_task(server, tmp_path):
    client = _client(server[0], "wait_usr2", tmp_path / "seen.json")
    _wait_for_file(tmp_path / "seen.json", client)  # written once its handler is installed
    client.send_signal(signal.SIGUSR2)
    client.communicate(timeout=60)
    assert client.returncode == 0  # the handler's exit, not 9 after the sleep


def test_a_killed_client_takes_its_task_along(server, tmp_path):
    client = _client(server[0], "sleep", tmp_path / "seen.json")
    task_pid = _wait_for_file(tmp_path / "seen.json", client)["pid"]
    client.kill()
    client.communicate(timeout=60)
    _wait_gone(task_pid)


def test_without_a_server_the_client_runs_the_interpreter_itself(tmp_path):
    client = _client(str(tmp_path / "none.sock"), "exit3", tmp_path / "seen.json")
    out, _ = client.communicate(timeout=60)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert client.returncode == 3 and out == "out line\n"
    assert seen["pid"] == client.pid  # exec'd in place


def test_an_idle_server_exits_on_its_own(tmp_path):
    path = str(tmp_path / "idle.sock")
    pid = rank_server.ensure_server(path, 0.5, preload=())
    _wait_gone(pid)
    assert not os.path.exists(path)
    with pytest.raises(OSError), socket.socket(socket.AF_UNIX) as probe:
        probe.connect(path)
