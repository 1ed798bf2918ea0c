"""Local ranks that start in a second: a preloaded process forks each task of a local run.

submitit's local executor starts every task of a job as a fresh interpreter (`python -u -m
submitit.core._submit <folder>`), and each imports the whole stack again: torch, megatron-core,
transformers and vLLM took 19 s of a rank's start on 2 cores (measured), against about 2 s of
steps in a tiny run. This server imports that stack once and forks a process per task instead, as
a build tool's daemon keeps a warm process between builds:

    launcher --starts--> server: imports torch, megatron-core, transformers, vLLM; waits for tasks
    submitit's controller --runs--> `python -m rft.runtime.rank_server run SOCKET -u -m submitit.core._submit DIR`
      that client --its stdin/stdout/stderr, environment, cwd and arguments--> server (unix socket)
      server --fork--> the task: the client's fds, environment and cwd; rft imported afresh; runs the module
      client: forwards its signals to the task and exits as the task did (code or signal)

multiprocessing's forkserver does this for one parent's Python functions; it cannot run commands
with their own fds and environment for independent processes (submitit's controller starts the
tasks), hence this small one.

The fork shares imported third-party code only: each task imports rft's own modules afresh (an
edit to rft takes effect at the next launch), and a server is named by a hash of what it
preloaded (the Python, the packages' install directories, the environment variables libraries
read when they load), so a changed install gets a new server and the old one idles out. Without a
server the client runs the fresh interpreter itself. Never on GPU machines: a process that touched
CUDA cannot fork, and vLLM's GPU platform detection is not free of that.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import io
import json
import os
import runpy
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import sys
import traceback

import setproctitle

# Imported once by the server, in this order; a module that is not installed is skipped.
PRELOAD = ("torch", "torch.distributed", "numpy", "pyarrow", "omegaconf", "hydra", "submitit", "rich",
           "megatron.core", "megatron.core.models.gpt", "megatron.core.dist_checkpointing",
           "transformers", "vllm", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm",
           # what vLLM's engine core imports as it starts (its worker, model runner, loader, sampler and
           # the model classes rft's families use): 1.1-1.5 s of an engine's start on 2 cores (measured)
           "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
           "vllm.model_executor.model_loader", "vllm.v1.sample.sampler", "vllm.model_executor.models.qwen2",
           "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen3")
# Imported only for the third-party modules they pull in, then forgotten: each task imports rft afresh.
RANK_MODULES = ("rft.runtime.task", "rft.trainer.trainer", "rft.explorer.rollout_rank", "rft.explorer.vllm_worker")
# Environment variables that libraries read once, when they load (OpenMP, MKL, OpenBLAS, the dynamic
# linker): a task must not run under the values a server preloaded with if its own differ.
# (PYTHONPATH is not among them: a task's sys.path is rebuilt from its own.)
_LOAD_TIME_ENV = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "LD_", "PYTHONHASHSEED", "HF_", "TRANSFORMERS_",
                  "TORCH", "PYTORCH_")
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def usable() -> bool:
    """Whether ranks may fork from a server here: Linux, and no GPU device (see the module doc)."""
    import glob

    return sys.platform == "linux" and not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd")


def _server_dir() -> str:
    """Where this user's servers listen; RFT_RANK_SERVER_DIR gives a set of launches servers of
    their own (the test suite's, stopped when it ends)."""
    return os.environ.get("RFT_RANK_SERVER_DIR") or f"/tmp/rft-{os.getuid()}"


def socket_path() -> str:
    """The server for this Python, this rft and these installed packages, in a directory only
    this user can enter (a unix socket path has at most 107 bytes)."""
    key = hashlib.sha256()
    key.update(os.path.realpath(sys.executable).encode())
    key.update(os.path.dirname(os.path.dirname(os.path.abspath(__file__))).encode())
    for name in sorted({module.split(".")[0] for module in PRELOAD}):
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            key.update(f"{location}:{os.stat(location).st_mtime_ns}".encode())
    key.update(json.dumps(sorted((k, v) for k, v in os.environ.items() if k.startswith(_LOAD_TIME_ENV))).encode())
    directory = _server_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return os.path.join(directory, f"ranks-{key.hexdigest()[:16]}.sock")


def ensure_server(path: str, idle_s: float, preload: tuple[str, ...] = PRELOAD) -> int | None:
    """Start a server on `path` unless one is there (it may still be preloading: tasks that connect
    meanwhile wait in its queue). Returns the pid of a server it started, once it listens."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.connect(path)
        return None
    server = subprocess.Popen([sys.executable, "-m", "rft.runtime.rank_server", "serve", path, str(idle_s),
                               ",".join(preload)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              start_new_session=True, close_fds=True)
    listening = server.stdout.readline()  # once bound; nothing if it exited (another server won the race)
    server.stdout.close()
    return server.pid if listening else None


def stop_server(path: str) -> bool:
    """Ask the server on `path` to stop once its tasks have ended; False if none answered."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(path)
            _send(conn, {"op": "stop"})
            return conn.makefile("r").readline().startswith("stopping")
    except OSError:
        return False


def stop_all_servers() -> int:
    """Ask every server of this user to stop once its tasks have ended; how many answered."""
    directory = _server_dir()
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sum(stop_server(os.path.join(directory, name)) for name in names if name.endswith(".sock"))


# ---- the server ----------------------------------------------------------------------------------

def serve(path: str, idle_s: float, preload: tuple[str, ...] = PRELOAD) -> None:
    """Listen on `path`, import `preload`, then fork a task per request until `idle_s` pass without one."""
    lock = open(path + ".lock", "w")  # held for the server's life: one server per path
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another server has it
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a dead server's
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(256)  # tasks that connect while it preloads wait in this queue
    print("listening", flush=True)
    log = os.open(path.removesuffix(".sock") + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    os.chdir("/")  # holds no directory of the launch that started it; each task goes to its own
    # setproctitle finds the space it rewrites in the environment as the process started: before
    # a task's environment replaces it (after, titles never reached /proc/<pid>/cmdline)
    setproctitle.getproctitle()
    set_by_imports = _preload(preload)
    _Server(listener, path, idle_s, lock, set_by_imports).loop()


def _preload(modules: tuple[str, ...]) -> dict[str, str]:
    """Import `modules`; returns the environment variables the imports set (torch and vLLM set
    some for their own subprocesses), which a task's environment takes as a fresh import would."""
    before = dict(os.environ)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - not installed, or broken: the task imports it itself
            print(f"not preloaded: {name}: {err}", flush=True)
    for name in RANK_MODULES if modules == PRELOAD else ():
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    _forget_rft()
    return {key: value for key, value in os.environ.items() if before.get(key) != value}


def _forget_rft() -> None:
    for name in [m for m in sys.modules if m == "rft" or m.startswith("rft.")]:
        del sys.modules[name]


class _Server:
    def __init__(self, listener: socket.socket, path: str, idle_s: float, lock, set_by_imports: dict[str, str]):
        self.listener, self.path, self.idle_s, self.lock = listener, path, idle_s, lock
        self.set_by_imports = set_by_imports
        self.tasks: dict[int, socket.socket] = {}  # task pid -> its client's connection
        self.stopping = False
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        # a task's end wakes the loop through SIGCHLD (one thread only: forking a threaded process
        # could leave a lock held in the child)
        self.wake_read, self.wake_write = socket.socketpair()
        self.wake_read.setblocking(False)
        self.wake_write.setblocking(False)
        signal.set_wakeup_fd(self.wake_write.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.wake_read, selectors.EVENT_READ, "reap")

    def loop(self) -> None:
        while True:
            idle = not self.tasks
            if idle and self.stopping:
                break
            events = self.selector.select(timeout=self.idle_s if idle else None)
            if not events and not self.tasks:
                break  # idle for idle_s
            for key, _ in events:
                if key.data == "accept":
                    self._accept()
                elif key.data == "reap":
                    self._reap()
                else:
                    self._client_gone(key.fileobj, key.data)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()  # a probe (ensure_server) or a client that left
            return
        if request.get("op") == "stop":
            self.stopping = True
            self.selector.unregister(self.listener)
            self.listener.close()
            os.unlink(self.path)
            conn.sendall(b"stopping\n")
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            try:
                self._become_task(request, fds, conn)
            finally:
                os._exit(1)  # _become_task ends the process itself
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        self.tasks[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _reap(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self.wake_read.recv(4096):
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.tasks.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(KeyError):  # not if its client is gone (_client_gone)
                    self.selector.unregister(conn)
                with contextlib.suppress(OSError):
                    conn.sendall(f"exit {status}\n".encode())
                conn.close()

    def _client_gone(self, conn: socket.socket, pid: int) -> None:
        """A client's connection is readable only when it closed: the client was killed (submitit's
        controller kills its tasks so), and its task goes as a directly started one would."""
        with contextlib.suppress(OSError):
            if conn.recv(1):
                return
        self.selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _become_task(self, request: dict, fds: list[int], conn: socket.socket) -> None:
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, *_SIGNALS):  # as a fresh interpreter has them
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        for sock in (self.listener, self.wake_read, self.wake_write, conn, *self.tasks.values()):
            sock.close()
        self.lock.close()  # else a task outliving the server would keep the next one from starting
        os.setsid()  # signals reach it through its client only, as they reached the fresh interpreter
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # what the preloaded imports would have set in a fresh interpreter: the load-time variables
        # as they set them (the client's equal the server's: the socket's name says so), others
        # where the client has none
        os.environ.update({key: value for key, value in self.set_by_imports.items()
                           if key.startswith(_LOAD_TIME_ENV) or key not in request["env"]})
        # the command line it stands in for, in ps and /proc/<pid>/cmdline: the launcher finds a
        # job's rank processes by it (rft/launch/job_state.py) to stop them after a failure
        setproctitle.setproctitle(shlex.join([sys.executable, *request["argv"]]))
        _run_python_args(request["argv"], request["cwd"])


def _run_python_args(argv: list[str], cwd: str) -> None:
    """Run `[-u] -m module args...` as `python` would in `cwd`, then end the process alike."""
    unbuffered = argv[0] == "-u"
    module, args = argv[1 + unbuffered], argv[2 + unbuffered:]
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", line_buffering=True,
                                  write_through=unbuffered, errors="backslashreplace" if fd == 2 else "strict")
        setattr(sys, name, stream)
    # python -m puts the working directory first, then PYTHONPATH; the rest is the server's (site-packages)
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *python_path, *[p for p in sys.path[1:] if p not in python_path]]
    importlib.invalidate_caches()
    sys.argv = [module, *args]
    code: int | str | None = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
    except KeyboardInterrupt:
        traceback.print_exc()
        _end(signal.SIGINT)  # as python does for an uncaught Ctrl-C
    except BaseException:  # noqa: BLE001 - reported as python reports it
        traceback.print_exc()
        code = 1
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    _end(None, code or 0)


def _end(signum: int | None, code: int = 0) -> None:
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if signum is not None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(code)


# ---- the client (the task command submitit's controller runs) -------------------------------------

def run_task(path: str, argv: list[str]) -> None:
    """Have the server on `path` run `python <argv>` as this process would, forwarding signals;
    exit as it did. Without a server (or for arguments it does not take): exec the interpreter."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not (argv[:1] == ["-m"] or argv[:2] == ["-u", "-m"]):
            raise OSError("only `[-u] -m module` runs in the server")
        conn.connect(path)
        _send(conn, {"op": "run", "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, fds=[0, 1, 2])
        replies = conn.makefile("r")
        started = replies.readline()
        if not started.startswith("pid "):
            raise OSError("the server did not start the task")
    except OSError:
        conn.close()
        os.execv(sys.executable, [sys.executable, *argv])
    pid = int(started.split()[1])

    def forward(signum: int, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in _SIGNALS:
        signal.signal(signum, forward)
    ended = replies.readline()  # a forwarded signal does not end the wait (PEP 475)
    if not ended.startswith("exit "):
        sys.exit("rft rank server: the server ended before this task did")
    status = int(ended.split()[1])
    if os.WIFSIGNALED(status):
        _end(os.WTERMSIG(status))
    sys.exit(os.WEXITSTATUS(status))


def _send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    payload = json.dumps(message).encode()
    socket.send_fds(conn, [struct.pack("!I", len(payload)) + payload], list(fds))


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    if len(data) < 4:
        raise ValueError("no request")
    (size,) = struct.unpack("!I", data[:4])
    payload = data[4:]
    while len(payload) < size:
        more = conn.recv(size - len(payload))
        if not more:
            raise ValueError("a truncated request")
        payload += more
    return json.loads(payload), fds


def main(args: list[str]) -> None:
    usage = ("usage: python -m rft.runtime.rank_server run SOCKET PYTHON-ARGS... | "
             "serve SOCKET IDLE_S [MODULE,MODULE...] | stop [SOCKET] (default: every server of this user)")
    if args[:1] == ["run"] and len(args) > 2:
        run_task(args[1], args[2:])
    elif args[:1] == ["serve"] and len(args) in (3, 4):
        serve(args[1], float(args[2]), tuple(m for m in args[3].split(",") if m) if len(args) == 4 else PRELOAD)
    elif args[:1] == ["stop"] and len(args) == 2:
        print("stopping" if stop_server(args[1]) else f"no rank server on {args[1]}")
    elif args[:1] == ["stop"]:
        print(f"stopping {stop_all_servers()} rank server(s)")
    else:
        sys.exit(usage)


if __name__ == "__main__":
    main(sys.argv[1:])
