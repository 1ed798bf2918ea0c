"""A real single-node Slurm (slurmctld + slurmd from Debian's slurm-wlm, slurmdbd on a private
MariaDB for sacct) for the tests here.

Started once per session by tools/slurm_local.sh (installing slurm-wlm first when running as root,
as CI does), stopped at the end if this session started it.
"""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tools", "slurm_local.sh")
SLURM_DIR = os.environ.get("RFT_SLURM_DIR", "/tmp/rft-slurm")


def _answers() -> bool:
    return subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def slurm():
    if any(shutil.which(daemon) is None for daemon in ("slurmctld", "slurmdbd", "mariadbd")):
        if os.geteuid() != 0:
            pytest.skip("slurm-wlm, slurmdbd or mariadb-server is not installed and installing needs "
                        "root: `sudo bash tools/slurm_local.sh install`")
        subprocess.run(["bash", SCRIPT, "install"], check=True)
    os.environ["SLURM_CONF"] = os.path.join(SLURM_DIR, "slurm.conf")
    started = False
    if not (os.path.exists(os.environ["SLURM_CONF"]) and _answers()):
        subprocess.run(["bash", SCRIPT, "start"], check=True, env={**os.environ, "RFT_SLURM_DIR": SLURM_DIR})
        started = True
    yield os.environ["SLURM_CONF"]
    if started:
        subprocess.run(["bash", SCRIPT, "stop"], env={**os.environ, "RFT_SLURM_DIR": SLURM_DIR})


def _another_slurm(suffix: str, settings: dict[str, str]):
    """A single-node Slurm beside the session's, in RFT_SLURM_DIR + suffix with `settings` (its own
    ports among them), without accounting; yields the environment a launcher needs to use it."""
    if shutil.which("slurmctld") is None:
        if os.geteuid() != 0:
            pytest.skip("slurm-wlm is not installed and installing needs root: `sudo bash tools/slurm_local.sh install`")
        subprocess.run(["bash", SCRIPT, "install"], check=True, env={**os.environ, "RFT_SLURM_ACCOUNTING": "0"})
    slurm_dir = SLURM_DIR + suffix
    instance = {"RFT_SLURM_DIR": slurm_dir, "RFT_SLURM_ACCOUNTING": "0", **settings}
    subprocess.run(["bash", SCRIPT, "stop"], env={**os.environ, **instance})  # a leftover of an aborted run
    shutil.rmtree(slurm_dir, ignore_errors=True)  # its saved node state too (a drained node stays drained)
    subprocess.run(["bash", SCRIPT, "start"], check=True, env={**os.environ, **instance})
    yield {**os.environ, **instance, "SLURM_CONF": os.path.join(slurm_dir, "slurm.conf")}
    subprocess.run(["bash", SCRIPT, "stop"], env={**os.environ, **instance})


@pytest.fixture(scope="module")
def gpu_slurm_env():
    """A second Slurm beside the session's, on other ports, whose node advertises 2 GPUs (gres on
    stand-in device files: jobs get CUDA_VISIBLE_DEVICES, the ranks still run on CPU) and which has
    no accounting (`sacct` says "Slurm accounting storage is disabled", as on many clusters).
    Yields the environment a launcher needs to use it."""
    yield from _another_slurm("-gpu", {"RFT_SLURMCTLD_PORT": "6827", "RFT_SLURMD_PORT": "6828", "RFT_SLURM_GPUS": "2"})


@pytest.fixture(scope="module")
def patient_slurm_env():
    """A Slurm whose cancel waits 30 s between its SIGTERM and its SIGKILL (KillWait; sites set 30 to
    120) and whose partition gives preempted jobs 60 s (GraceTime). The session's waits 5 s, which a
    step and a save fit on an idle machine but not surely under the suite's load."""
    yield from _another_slurm("-patient", {"RFT_SLURMCTLD_PORT": "6847", "RFT_SLURMD_PORT": "6848",
                                           "RFT_SLURM_KILL_WAIT": "30", "RFT_SLURM_GRACE_TIME": "60"})


@pytest.fixture(scope="session")
def two_nodes():
    """A second Slurm, of two nodes: each a network namespace with its own address (10.213.0.11,
    10.213.0.12) and hostname (node1, node2) and its own slurmd, on a bridge; accounting on its
    own slurmdbd and MariaDB. Skips where it cannot run (not root, no network namespaces).
    Yields the environment a launcher needs to use it; stopped (namespaces removed) at the end."""
    if any(shutil.which(tool) is None for tool in ("slurmctld", "slurmdbd", "mariadbd", "ip")):
        if os.geteuid() != 0:
            pytest.skip("slurm-wlm, slurmdbd or mariadb-server is not installed and installing needs root")
        subprocess.run(["bash", SCRIPT, "install"], check=True)
    slurm_dir = SLURM_DIR + "-nodes"
    instance = {"RFT_SLURM_DIR": slurm_dir, "RFT_SLURM_NODES": "2", "RFT_SLURM_CLUSTER": "rftnodes",
                "RFT_SLURMCTLD_PORT": "6837", "RFT_SLURMD_PORT": "6838", "RFT_SLURMDBD_PORT": "6839",
                "RFT_SLURM_DB_PORT": "3308"}
    env = {**os.environ, **instance}
    subprocess.run(["bash", SCRIPT, "stop"], env=env, capture_output=True)  # a leftover of an aborted run
    shutil.rmtree(os.path.join(slurm_dir, "state"), ignore_errors=True)  # a drained node stays drained
    started = subprocess.run(["bash", SCRIPT, "start"], env=env, capture_output=True, text=True)
    if started.returncode == 3:
        pytest.skip(started.stderr.strip())
    assert started.returncode == 0, started.stdout + started.stderr
    yield {**env, "SLURM_CONF": os.path.join(slurm_dir, "slurm.conf")}
    subprocess.run(["bash", SCRIPT, "stop"], env=env)
