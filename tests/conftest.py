"""Shared test setup: where the GSM8K files live (the checkout sits beside ../shared), one
shortened quickstart run whose SFT'd model later tests start from, and the seconds spent per
test file."""

import os
import signal

# Before anything imports torch (OpenMP reads it once, at load): the suite's processes (xdist's
# workers, the dist tests' preloaded ranks) let idle OpenMP threads sleep, as a launch does for
# ranks without GPUs (rft/launch/submit.py, _idle_threads_sleep): two workers share 2 cores, and
# spinning threads of one took the cores the other's work needed.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from tests.e2e.helpers import QUICKSTART_GRPO_STEPS, QUICKSTART_SFT_STEPS, launch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_DIR = os.environ.get("RFT_GSM8K_DIR") or os.path.join(os.path.dirname(REPO), "shared", "data", "gsm8k")
os.environ["RFT_GSM8K_DIR"] = GSM8K_DIR

# The suite's local launches fork their ranks from rank servers of its own (rft/runtime/rank_server.py),
# stopped when it ends (pytest_sessionfinish), whatever servers the user or another session runs.
# xdist's workers inherit the controller's directory.
os.environ.setdefault("RFT_RANK_SERVER_DIR", f"/tmp/rft-{os.getuid()}/pytest-{os.getpid()}")

# A shell starts a background command (CI under `&` or nohup) with SIGINT ignored, and every process
# a test starts inherits that: Python then never raises KeyboardInterrupt, and a test's Ctrl-C of a
# launcher was silently dropped (the launcher ran on until the test's timeout). A handler (unlike
# SIG_IGN) is reset to the default across exec, so children get Ctrl-C back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def gsm8k_dir() -> str:
    if not os.path.exists(os.path.join(GSM8K_DIR, "train.jsonl")):
        pytest.skip(f"GSM8K files not found in {GSM8K_DIR}; set RFT_GSM8K_DIR")
    return GSM8K_DIR


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory, worker_id) -> tuple[str, str]:
    """The quickstart with shortened stages, on this machine: (run dir, launcher stdout). It leaves
    its model at SFT's end (`exported_sft_model`) and at the run's end (`exported_grpo_model`), so
    that tests of GRPO variants (LoRA, two engines on Slurm, the presets) need no SFT warm-up of
    their own, and distillation has a student and a teacher; it also exports HF checkpoints half way
    through SFT, at its end and at the run's end (trainer.save_hf, for mode=bench's test) and
    checkpoints at the last step (the final model's logprobs are checked against it).

    Under pytest-xdist (`-n 2`) each worker is a session of its own: the first to ask runs it under
    a file lock in the directory the workers share, the others wait for it and read its result."""
    if worker_id == "master":
        return _run_quickstart(str(tmp_path_factory.mktemp("quickstart")))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/, above each worker's popen-gwK/
    stdout_file = shared / "quickstart.stdout"
    with FileLock(str(shared / "quickstart.lock")):
        if not stdout_file.exists():
            stdout_file.write_text(_run_quickstart(str(shared / "quickstart"))[1])
    return str(shared / "quickstart"), stdout_file.read_text()


def _run_quickstart(run_dir: str) -> tuple[str, str]:
    result = launch("+experiment=quickstart", f"run.output_dir={run_dir}",
                    f"stages.0.trainer.max_steps={QUICKSTART_SFT_STEPS}",
                    f"stages.1.trainer.max_steps={QUICKSTART_GRPO_STEPS}",
                    f"trainer.save_interval={QUICKSTART_SFT_STEPS // 2}", "trainer.save_hf=true",
                    # the GRPO stage saves once, at the run's end (the interval counts the run's steps)
                    f"++stages.1.trainer.save_interval={QUICKSTART_SFT_STEPS + QUICKSTART_GRPO_STEPS}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir, result.stdout


@pytest.fixture(scope="session")
def exported_sft_model(quickstart_run) -> str:
    """The quickstart's model at the end of its shortened SFT warm-up (300 steps, half the
    quickstart's), as a HF directory (`model.path=`). Short of the full warm-up on purpose: the GRPO
    variants started from it must show that they learn, and the full warm-up's 600 steps already
    score about 90% on the held-out tasks (seeds 0-2, measured), where +5 points is at the ceiling
    and one run's noise; after 300 it scored 78% (seed 0, AMD EPYC; 250 steps: 15-41% over seeds
    0-2). (The SFT learning rate is constant after its warm-up, so this is the model a full warm-up
    has half way.)"""
    return os.path.join(quickstart_run[0], "models", "sft")  # the stage's final model (trainer.save_model)


@pytest.fixture(scope="session")
def exported_grpo_model(quickstart_run) -> str:
    """The quickstart's model at the run's end (its GRPO stage after the shortened warm-up, on the
    held-out tasks: 93.5% after 40 steps on a 2-core AMD EPYC, 91.5% after 70 on a 2-core Intel Xeon,
    where 40 gave 85%, too close to the 80.5% student for distillation's test), as a HF directory: a
    teacher for distillation."""
    return os.path.join(quickstart_run[0], "model")  # the run's final model (trainer.save_model)


# The order the suite runs in, and what runs side by side under pytest-xdist (README: `-n 2`; pyproject's
# addopts give `--dist loadfile`). Two workers on 2 cores pay only where a core idles. tests/slurm
# mostly waits (on Slurm, on the timeouts its faults must outlast, on nodes coming back): run alone it
# kept 1.2 cores busy, tests/unit 0.9, tests/dist 1.5, where a local launch's ranks keep about 1.6 busy (CPU seconds
# over wall seconds, each folder run alone, 2-core AMD EPYC, 2026-11-29). Dealing each file to whichever
# worker was free (xdist's own loadfile) put two launches side by side: 107 min, as long as one after
# another, with timing bounds missed under the doubled load. So the first worker runs the Slurm
# instances' tests and then the launches of tests/e2e one after another; the second runs the files of
# _BESIDE_SLURM in the meantime. (Moving the two-node Slurm's tests to the second worker, which idles
# at the end, made the suite no shorter: 59 min of pytest against 60, with the e2e files at 3115 s
# against 1965 beside it and the two-node run's 30 s sync timeout missed under the load; 2026-11-29.)
_FOLDER_ORDER = ("tests/slurm", "tests/e2e", "tests/dist", "tests/unit")
# Each Slurm instance's tests are one unit of work on one worker: an instance listens on fixed ports and is
# started and stopped by a fixture of the worker's session or module. The session's single node (`slurm`,
# and `gpu_slurm_env` beside it) is one unit; each instance named here, on ports of its own, is another.
_ONE_UNIT = "tests/slurm/"
_OWN_INSTANCE = {"tests/slurm/test_multinode.py": "two_nodes", "tests/slurm/test_slurm_requeue.py": "two_nodes",
                 "tests/slurm/test_slurm_preemption.py": "patient_slurm_env"}
# The second worker's files: tests/unit and tests/dist, then e2e files without timing bounds, which fill
# that worker's idle end: the doctor, the GPU-list launch, the SmolLM2 conversion, the resharded resumes
# and rft.export, the final model's checks and mode=bench (these two on the shared quickstart run), a
# sweep launched again (SFT only: no engine, no timeout to meet), and launches whose checks are of
# results, not of time (learning, exact resume, the first-contact refusals). In the CI run of e28dc55
# the second worker was done after about 2100 s and the first after 4040 s (72 min in all with
# install); the files moved here since took about 660 s there. With the ranks' OpenMP threads asleep
# when idle (OMP_WAIT_POLICY above), two launches side by side no longer starve each other. A fresh
# clone's run of b0e44a8 on this machine: the first worker 3262 s, the second 2952 s (pytest 55 min,
# 60 with install); the tools' child-process checks (126 s, their waits bounded at minutes) moved here,
# and each model family through the launcher (81 s, no longer `heavy`) joined it.
_BESIDE_ORDER = ("tests/unit/", "tests/dist/", "tests/e2e/")
_BESIDE_SLURM = ("tests/unit/", "tests/dist/", "tests/e2e/test_doctor.py", "tests/e2e/test_local_gpus.py",
                 "tests/e2e/test_smollm2_prepare.py", "tests/e2e/test_reshard.py", "tests/e2e/test_final_model.py",
                 "tests/e2e/test_bench.py", "tests/e2e/test_sweep_relaunch.py", "tests/e2e/test_data_pipeline.py",
                 "tests/e2e/test_first_contact.py", "tests/e2e/test_quickstart.py", "tests/e2e/test_free_run.py",
                 "tests/e2e/test_distillation.py", "tests/e2e/test_algorithm_presets_run.py", "tests/e2e/test_async.py",
                 "tests/e2e/test_ppo_resume.py", "tests/e2e/test_quickstart_vl.py",
                 "tests/e2e/test_tools_end_children.py", "tests/e2e/test_families_run.py")


def _unit_of(path: str) -> str:
    """The unit of work a test file belongs to: its Slurm instance's, or the file itself."""
    if path in _OWN_INSTANCE:
        return _ONE_UNIT + _OWN_INSTANCE[path]
    return _ONE_UNIT if path.startswith(_ONE_UNIT) else path


def pytest_xdist_make_scheduler(config, log):
    """xdist's per-file scheduling with each Slurm instance's tests as one unit and, on 2 workers, the
    split above.
    (xdist's own `loadgroup` would group from marks, but it renames node ids in a way pytest 9.2 no
    longer sees: the groups were split.)"""
    if config.getvalue("dist") != "loadfile":
        return None  # another --dist given on the command line: xdist's own
    from xdist.scheduler import LoadFileScheduling

    class BesideSlurmScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid.split("::", 1)[0])

        def schedule(self) -> None:
            """On 2 workers: every unit handed out at once, in the suite's order, to the worker
            its folder runs on (above); else xdist's own dealing."""
            if self.collection is not None or len(self.nodes) != 2 or not self._check_nodes_have_same_collection():
                return super().schedule()
            collection = list(next(iter(self.registered_collections.values())))
            units: dict[str, dict[str, bool]] = {}
            for nodeid in collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            beside = {scope: unit for scope, unit in units.items() if scope.startswith(_BESIDE_SLURM)}
            if not beside or len(beside) == len(units):
                return super().schedule()  # nothing to put side by side
            self.collection = collection
            launches, quiet = sorted(self.nodes, key=lambda node: node.gateway.id)
            # on the second worker tests/unit first: it keeps one core busy while tests/slurm's first test
            # makes the shared quickstart run (about 1.6 cores); then tests/dist, then the e2e files
            def second_order(scope: str) -> int:
                return next((i for i, folder in enumerate(_BESIDE_ORDER) if scope.startswith(folder)), 0)

            for scope, unit in sorted(units.items(), key=lambda item: second_order(item[0]) if item[0] in beside else 0):
                node = quiet if scope in beside else launches
                self.assigned_work[node][scope] = unit
                node.send_runtest_some([self.registered_collections[node].index(nodeid) for nodeid in unit])
            for node in self.nodes:
                node.shutdown()  # each has all its work: it ends once that is done

    return BesideSlurmScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Orders the tests (above); tests marked `gpu` run where CUDA is present and are skipped
    elsewhere (CI, laptops)."""
    def path(item) -> str:
        return item.nodeid.split("::", 1)[0]

    # outside tests/slurm, files that need the quickstart run come after those that do not: while
    # tests/slurm's first test makes it on one worker, the other has other work than to wait
    waits = {path(item) for item in items if "quickstart_run" in item.fixturenames and not path(item).startswith(_ONE_UNIT)}

    def order(item) -> tuple[int, bool]:
        folder = next((i for i, f in enumerate(_FOLDER_ORDER) if path(item).startswith(f + "/")), len(_FOLDER_ORDER))
        return folder, path(item) in waits

    items.sort(key=order)  # stable: within a file, its own order
    instances = set(_OWN_INSTANCE.values())
    for item in items:  # a Slurm instance's fixture used from another unit would start it twice, side by side
        uses = instances.intersection(item.fixturenames)
        if path(item).startswith(_ONE_UNIT) and uses != ({_OWN_INSTANCE[path(item)]} if path(item) in _OWN_INSTANCE else set()):
            raise pytest.UsageError(f"{item.nodeid} uses the Slurm instances {sorted(uses) or 'of the session only'}: "
                                    "its file's entry in tests/conftest.py's _OWN_INSTANCE must name the one it uses")
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Seconds spent per test file (setup, call and teardown together): the suite must stay within CI's
# hour on 2 cores, and --durations alone lists single tests, not where a file's time adds up.
_SECONDS_BY_FILE: dict[str, float] = {}
_SECONDS_BY_WORKER: dict[str, float] = {}  # how the split below the scheduler shares the hour out


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _SECONDS_BY_FILE[path] = _SECONDS_BY_FILE.get(path, 0.0) + report.duration
    worker = getattr(getattr(report, "node", None), "gateway", None)
    if worker is not None:
        _SECONDS_BY_WORKER[worker.id] = _SECONDS_BY_WORKER.get(worker.id, 0.0) + report.duration


def pytest_sessionfinish(session):
    """The rank servers the suite's local launches started end with the suite, not 10 idle minutes
    later (under xdist: when the last worker is done)."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the others may still launch
    from rft.runtime import rank_server

    rank_server.stop_all_servers()


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS_BY_FILE:
        return
    terminalreporter.section("seconds per test file (top 40)")
    for path, seconds in sorted(_SECONDS_BY_FILE.items(), key=lambda kv: -kv[1])[:40]:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    by_folder: dict[str, float] = {}
    for path, seconds in _SECONDS_BY_FILE.items():
        folder = os.path.dirname(path)
        by_folder[folder] = by_folder.get(folder, 0.0) + seconds
    terminalreporter.write_line("  ".join(f"{folder}: {seconds:.0f} s" for folder, seconds in sorted(by_folder.items())))
    if _SECONDS_BY_WORKER:
        terminalreporter.write_line("  ".join(f"worker {w}: {s:.0f} s" for w, s in sorted(_SECONDS_BY_WORKER.items())))
