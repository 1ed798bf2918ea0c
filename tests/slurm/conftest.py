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
