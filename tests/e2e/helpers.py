"""Run the real launcher as a user would and read what it leaves on disk."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the shortened quickstart of the session fixture `quickstart_run` (tests/conftest.py). Its GRPO stage's
# gain from the same seed differs by CPU: after 40 steps +15.5 points on a 2-core AMD EPYC and +4.5 on
# a 2-core Intel Xeon (80.5% -> 85%; +3.8 on 2000 more unseen problems), short of test_quickstart's +5;
# after 70 on the Xeon +11 (80.5% -> 91.5%; +10.7 on the 2000), 2026-11-30
QUICKSTART_SFT_STEPS, QUICKSTART_GRPO_STEPS = 300, 70


def launch(*overrides: str, timeout: int = 1200, env: dict[str, str] | None = None,
           cwd: str = REPO) -> subprocess.CompletedProcess:
    """`python -m rft.launch`; on this machine (cluster=local) unless an override names a cluster,
    since `cluster=auto` would pick the test Slurm when tests/slurm has started one. `env`: the
    launcher's environment (default: this process's), e.g. another Slurm's SLURM_CONF; `cwd`: where
    it is launched from (the repository's root by default)."""
    if not any(o.startswith("cluster=") for o in overrides):
        overrides = ("cluster=local", *overrides)
    if not any(o.startswith("monitor.plots=") for o in overrides):
        # drawing costs a launch about 3 s (matplotlib); the tests of plots ask for them
        overrides = (*overrides, "monitor.plots=false")
    args = [sys.executable, "-m", "rft.launch", *overrides, "monitor.progress=false"]
    launcher = subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM, not subprocess.run's SIGKILL: the launcher then cancels its job. A killed launcher
        # left a Slurm job running, and the next Slurm test waited behind it and failed too.
        stop_launcher(launcher)
        stdout, stderr = launcher.communicate()
        raise AssertionError(f"the launcher ran past {timeout} s:\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(args, launcher.returncode, stdout, stderr)


def tensorboard_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's TensorBoard runs (one per rank, tensorboard/<rank>/), as
    TensorBoard shows them (a resumed rank's purged steps hidden): tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for rank_dir in sorted(glob.glob(os.path.join(run_dir, "tensorboard", "*", ""))):
        acc = EventAccumulator(rank_dir, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return scalars


def launch_until_step(overrides: list[str], run_dir, step: int) -> subprocess.Popen:
    """Start the launcher in the background; return once its run has done `step` steps."""
    launcher = subprocess.Popen([sys.executable, "-m", "rft.launch", *overrides], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while progress_step(run_dir) < step:
        if launcher.poll() is not None or time.time() > deadline:
            stop_launcher(launcher)
            raise AssertionError(f"the run did not reach step {step}: {launcher.communicate()}")
        time.sleep(0.2)
    return launcher


def leftovers(run_dir, ranks) -> list[str]:
    """Processes still in the process group of any of these ranks (each rank leads one:
    rft/runtime/supervisor.py), e.g. an orphaned vLLM engine: "<pid> <command>"."""
    groups = {int((Path(run_dir) / "pids" / f"rank{r}.pid").read_text()) for r in ranks}
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) in groups:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{entry} {command}")
        except (OSError, ValueError, IndexError):
            continue
    return found


def wait_for_step(launcher: subprocess.Popen, run_dir, step: int, timeout_s: float = 600) -> None:
    """Return once the run has done `step` steps; AssertionError if the launcher ends first."""
    deadline = time.time() + timeout_s
    while progress_step(run_dir) < step:
        assert launcher.poll() is None and time.time() < deadline, f"the run ended or stalled before step {step}"
        time.sleep(0.2)


def kill_like_a_node_failure(launcher: subprocess.Popen, run_dir) -> None:
    """SIGKILL the launcher (started with start_new_session=True) and every rank's process group,
    vLLM engines included, and wait until they are gone: what a node failure leaves."""
    import signal

    os.killpg(launcher.pid, signal.SIGKILL)  # launcher, its submitit controller, the ranks
    launcher.wait()
    for pid_file in (Path(run_dir) / "pids").glob("rank*.pid"):  # ranks and their supervisors
        try:  # each rank leads a process group with its vLLM engine in it: a node failure ends both
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    ranks = [int(p.stem[4:]) for p in (Path(run_dir) / "pids").glob("rank*.pid") if p.stem[4:].isdigit()]
    for _ in range(50):  # SIGKILLed processes take a moment to go
        if not leftovers(run_dir, ranks):
            break
        time.sleep(0.2)
    assert not leftovers(run_dir, ranks)


def stop_launcher(launcher: subprocess.Popen) -> None:
    """A test's cleanup: SIGTERM first (the launcher then stops its local ranks and vLLM engines;
    a SIGKILL would orphan them for the rest of the suite), SIGKILL if that does not end it."""
    if launcher.poll() is None:
        launcher.terminate()
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


def progress_step(run_dir) -> int:
    """Steps the run has done, from the launcher's progress file (0 before the first)."""
    try:
        with open(os.path.join(run_dir, "progress.json")) as f:
            return json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return 0


def assert_same_run(reference, resumed, done: int, states: dict[int, tuple[str, ...]],
                    logs: tuple[str, ...] = ("trainer0", "rollout1", "eval")) -> None:
    """`resumed` ended as `reference` did, bit for bit (rft/runtime/equivalence.py)."""
    from rft.runtime.equivalence import run_differences

    found = run_differences(str(reference), str(resumed), done, states, logs)
    assert not found, f"{len(found)} differences from the uninterrupted run, e.g. {found[:5]}"


@contextlib.contextmanager
def mlflow_server(store_dir) -> Iterator[str]:
    """MLflow's own tracking server on localhost (SQLite backend under `store_dir`); yields its URL."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1", "--backend-store-uri", f"sqlite:///{store_dir}/mlflow.db",
                               "--default-artifact-root", str(store_dir)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:  # its workers did not wind down in time (seen on a loaded machine)
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def tracked_steps(run_dir, rank: str, tracking_uri: str) -> dict[str, dict[str, list[int]]]:
    """What MLflow (its server) and W&B (the offline files of every attempt) hold of one rank's
    scalars, {"mlflow": {key: steps}, "wandb": {key: steps}}, next to its jsonl ({"jsonl": ...})."""
    from mlflow import MlflowClient

    from rft.runtime.trackers.wandb_files import history

    ids = json.loads((Path(run_dir) / "metrics" / f"{rank}.trackers.json").read_text())
    client = MlflowClient(tracking_uri)
    out: dict[str, dict[str, list[int]]] = {"mlflow": {}, "wandb": {}, "jsonl": {}}
    for key in client.get_run(ids["mlflow"]).data.metrics:
        out["mlflow"][key] = [m.step for m in sorted(client.get_metric_history(ids["mlflow"], key), key=lambda m: m.step)]
    for row in history(str(run_dir), ids["wandb"]):
        for key in row:
            if key != "_step":
                out["wandb"].setdefault(key, []).append(row["_step"])
    for row in map(json.loads, (Path(run_dir) / "metrics" / f"{rank}.jsonl").read_text().splitlines()):
        for key in row:
            if key not in ("step", "stage", "time"):
                out["jsonl"].setdefault(key, []).append(row["step"])
    return out


def process_state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped, Z: a zombie), "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def stopped_by_fault(run_dir, fault: str, step: int, rank: int | None = None) -> int | None:
    """The pid of a rank (of rank `rank`, if given) that has stopped itself (SIGSTOP) at `fault`'s
    point of `step` (RFT_FAULTS, rft/runtime/faults.py: it records that in <run_dir>/faults.jsonl,
    then stops); None before. Tests wait on it to fault a run at a step, whatever the machine's speed."""
    try:
        struck = [json.loads(line) for line in Path(run_dir, "faults.jsonl").read_text().splitlines()]
    except (OSError, ValueError):  # not written yet, or its line half written
        return None
    pids = [row["pid"] for row in struck if (row["fault"], row["step"]) == (fault, step) and rank in (None, row["rank"])]
    return next((pid for pid in pids if process_state(pid) == "T"), None)
