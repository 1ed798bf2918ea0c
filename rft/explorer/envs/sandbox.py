"""Run untrusted Python (code a model wrote) in a subprocess with limits, off the network.

    result = run_python("print(2 ** 100)", timeout_s=5)
    result.summary()   # "1267650600228229401496703205376", or "error: ZeroDivisionError: ... (line 1)"

Each call starts a fresh `python -I -S -B` (the standard library only: no site-packages, no
PYTHON* variables, no bytecode written) in its own session, with a fresh temporary directory as
cwd, HOME and TMPDIR, a minimal environment (nothing of the parent's, so no secrets), and the
code on stdin. The layers, strongest first; `isolation_layers()` says which are active here:

1. Network namespace (`unshare -n`, or `unshare -rn` in an unprivileged user namespace): the
   child has no interface but a loopback that is down. This is the real network wall. Probed
   once; where the OS refuses it, a warning is logged and the layers below are all there is.
2. Landlock (Linux >= 5.13, where the kernel enables it): the kernel refuses writes outside the
   temporary directory, reads outside it, the standard library and the shared-library folders
   (so code cannot read the taskset's answers or a key file), running any program (execve), and
   from ABI 4 every TCP bind/connect, from ABI 6 signals and abstract Unix sockets that leave
   the sandbox. A real wall for files, applied by the child before it runs the code.
3. Resource limits: wall-clock timeout (the whole process group is killed), RLIMIT_CPU,
   RLIMIT_AS (memory), RLIMIT_FSIZE (one file's size), RLIMIT_CORE=0, RLIMIT_NOFILE.
4. A Python audit hook (`sys.addaudithook`) that refuses sockets, opening files for writing (or
   reading) outside the allowed folders, removing/renaming/chmod-ing paths outside the
   temporary directory, spawning processes (subprocess, os.system, os.exec*, os.posix_spawn,
   os.fork), ctypes, and signals to other processes. It turns most attempts into a clear
   PermissionError for the model, but it is a Python-level guard, not a security boundary:
   native code, or Python clever enough to reach the hook's state, gets past it.

Not enforced: the total disk space written inside the temporary directory (only each file's size
and the time limit bound it); Unix sockets named by a path, fork and setsid (only the audit hook
refuses them: RLIMIT_NPROC is not set because it counts every process of the user, and root
ignores it); without Landlock, reads and writes outside are refused by the audit hook alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Hand-written: the maintained options need a daemon or a container (llm-sandbox, epicbox,
# SandboxFusion), a setuid/compiled binary (nsjail, bubblewrap) or admin setup (codejail's
# AppArmor); RestrictedPython runs in-process. Plain subprocess + rlimits + unshare + Landlock needs none.

_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE: one file (stdout included) may not grow past this
_OPEN_FILES = 64  # RLIMIT_NOFILE
# Folders of shared libraries the standard library's C extensions load (_decimal, _ssl, ...);
# the child adds its own sys.path. Read-only; nothing else outside the temp dir is readable.
_LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache",
                 "/usr/share/zoneinfo", "/dev/null", "/dev/zero", "/dev/urandom")
_AUDIT_HOOK = True  # tests switch it off to check that the kernel layers hold on their own

# The child: read the code, apply Landlock, set rlimits, install the audit hook, run the code.
# Kept as text because it runs in `python -I -S` (the rft package is not importable there).
_CHILD = r'''
import json, os, resource, struct, sys
cfg = json.loads(sys.argv[1])
src = sys.stdin.read()
home = os.path.realpath(cfg["home"])
reads = tuple(os.path.realpath(p) for p in cfg["read"] + [p for p in sys.path if p])
reads = tuple(p for p in reads if os.path.exists(p))

def landlock(abi):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def check(ret, what):
        if ret < 0:
            err = ctypes.get_errno()
            raise OSError(err, "landlock: " + what + ": " + os.strerror(err))
        return ret
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    attr = struct.pack("QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    attr = attr[:8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = check(libc.syscall(444, attr, len(attr), 0), "create_ruleset")
    file_rights = 1 | 2 | 4 | (1 << 14 if abi >= 3 else 0)
    def allow(path, rights):
        if not os.path.isdir(path):
            rights &= file_rights
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        check(libc.syscall(445, ruleset, 1, struct.pack("=Qi", rights & fs, fd), 0), "add_rule " + path)
        os.close(fd)
    for path in reads:
        allow(path, 4 | 8)  # READ_FILE | READ_DIR
    allow("/dev/null", 2 | 4)
    allow(home, fs & ~1)  # everything but EXECUTE
    check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
    check(libc.syscall(446, ruleset, 0), "restrict_self")
    os.close(ruleset)

if cfg["landlock"]:
    landlock(cfg["landlock"])
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.")]:
        del sys.modules[name]  # so the code's `import ctypes` meets the hook's refusal
import ast, linecache, traceback
for name, value in (("AS", cfg["memory"]), ("CPU", cfg["cpu"]), ("FSIZE", cfg["fsize"]),
                    ("CORE", 0), ("NOFILE", cfg["nofile"])):
    resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# event -> (path argument, its dir_fd argument, "w" write / "wf" write following links / "r" read)
CHECKS = {
    "os.remove": ((0, 1, "w"),), "os.rmdir": ((0, 1, "w"),), "os.mkdir": ((0, 2, "w"),),
    "os.rename": ((0, 2, "w"), (1, 3, "w")), "os.link": ((0, 2, "w"), (1, 3, "w")),
    "os.symlink": ((1, 2, "w"),), "os.chmod": ((0, 2, "wf"),), "os.chown": ((0, 3, "wf"),),
    "os.utime": ((0, 3, "wf"),), "os.truncate": ((0, None, "wf"),), "os.chflags": ((0, None, "wf"),),
    "os.lchflags": ((0, None, "w"),), "os.setxattr": ((0, None, "wf"),),
    "os.removexattr": ((0, None, "wf"),), "os.listdir": ((0, None, "r"),), "os.scandir": ((0, None, "r"),),
    "shutil.rmtree": ((0, 1, "w"),), "shutil.copyfile": ((0, None, "r"), (1, None, "wf")),
    "shutil.copymode": ((0, None, "r"), (1, None, "wf")), "shutil.copystat": ((0, None, "r"), (1, None, "wf")),
    "shutil.copytree": ((0, None, "r"), (1, None, "wf")), "shutil.move": ((0, None, "w"), (1, None, "wf")),
    "shutil.chown": ((0, None, "wf"),), "shutil.unpack_archive": ((0, None, "r"), (1, None, "wf")),
    "shutil.make_archive": ((0, None, "wf"),), "sqlite3.connect": ((0, None, "wf"),),
}
DENIED = ("socket.", "subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
          "os.forkpty", "os.popen", "pty.", "ctypes.", "gc.get_referrers", "gc.get_referents",
          "gc.get_objects", "os.setsid", "os.setpgid")
# C modules that start programs or write files without raising audit events
DENIED_IMPORTS = ("_posixsubprocess", "_dbm", "_gdbm", "readline")

def hook(event, args, home=home, reads=reads, os=os, CHECKS=CHECKS, DENIED=DENIED,
         DENIED_IMPORTS=DENIED_IMPORTS, WRITE_FLAGS=WRITE_FLAGS):
    # everything it reads is bound here: the code's `import __main__` must not reach it
    def where(path, dir_fd=None, follow=True):
        if isinstance(path, int):
            path = os.readlink("/proc/self/fd/%d" % path)
            if not path.startswith("/"):
                return home  # a pipe or socket fd: not a place in the filesystem
        path = os.fsdecode(os.fspath(path if path is not None else "."))
        if not os.path.isabs(path):
            base = os.getcwd() if dir_fd in (None, -1) else os.readlink("/proc/self/fd/%d" % dir_fd)
            path = os.path.join(base, path)
        if follow:
            return os.path.realpath(path)
        head, tail = os.path.split(os.path.normpath(path))
        return os.path.join(os.path.realpath(head), tail)
    def under(path, roots):
        return any(path == root or path.startswith(root + "/") for root in roots)
    def refuse(what, why=""):
        raise PermissionError("sandbox: " + what + " is not allowed" + why)
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return  # an fd already open keeps the rights it was opened with
        writing = any(c in mode for c in "wax+") if mode else bool(flags & WRITE_FLAGS)
        try:
            place = where(path)
        except (OSError, ValueError, TypeError):
            refuse("opening %r" % (path,))
        if writing and not under(place, (home,)):
            refuse("writing " + place, " (only the current directory is writable)")
        if not writing and not under(place, reads + (home,)):
            refuse("reading %s" % place)
    elif event in CHECKS:
        for index, fd_index, need in CHECKS[event]:
            if event == "sqlite3.connect" and args[0] in (":memory:", ""):
                continue
            try:
                place = where(args[index], None if fd_index is None else args[fd_index], need != "w")
            except (OSError, ValueError, TypeError):
                refuse(event)
            if not under(place, (home,) if need != "r" else reads + (home,)):
                refuse(event + " on " + place, "" if need == "r" else
                       " (only the current directory is writable)")
    elif event.startswith(DENIED):
        refuse(event)
    elif event in ("os.kill", "os.killpg") and args[0] not in (0, os.getpid()):
        refuse("signalling another process")
    elif event == "import" and args[0] in DENIED_IMPORTS:
        raise ImportError("sandbox: module %s is not allowed" % args[0])

if cfg["hook"]:
    sys.addaudithook(hook)
del hook, landlock, CHECKS, DENIED, DENIED_IMPORTS, WRITE_FLAGS

class Counting:
    """sys.stdout that knows whether anything was printed (for show_last)."""
    def __init__(self, stream):
        self.stream, self.written = stream, False
    def write(self, text):
        self.written = self.written or bool(text)
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)

linecache.cache["main.py"] = (len(src), None, src.splitlines(True), "main.py")
scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    tree = compile(src, "main.py", "exec", ast.PyCF_ONLY_AST)
    last = None
    if cfg["show_last"] and tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
        sys.stdout = Counting(sys.stdout)
    exec(compile(tree, "main.py", "exec"), scope)
    if last is not None:
        value = eval(compile(last, "main.py", "eval"), scope)
        if value is not None and not getattr(sys.stdout, "written", True):
            print(repr(value))
except SystemExit:
    raise
except BaseException as error:
    tb = error.__traceback__
    traceback.print_exception(type(error), error, tb.tb_next if tb is not None else None)
    sys.exit(1)
'''


@dataclass(frozen=True)
class SandboxResult:
    """What the code did. `error` is one line for the model ("" when it ran cleanly)."""

    stdout: str  # the first max_output_chars characters
    stderr: str  # the last max_output_chars characters (a traceback's end is what matters)
    returncode: int  # negative: killed by that signal
    timed_out: bool = False  # wall-clock or CPU limit hit
    memory_exceeded: bool = False  # best effort: a MemoryError escaped the code
    error: str = ""  # e.g. "ZeroDivisionError: division by zero (line 3)", "timed out after 5s"

    def summary(self) -> str:
        """Short text to show the model: the output, then "error: ..." if it failed."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.error:
            parts.append(f"error: {self.error}")
        return "\n".join(parts) if parts else "(no output)"


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000,
               show_last_expression: bool = False) -> SandboxResult:
    """Run `code` as a script in a fresh sandboxed interpreter; never raises for what the code does.

    `show_last_expression`: if the code prints nothing and ends with an expression statement, its
    repr is printed (as a REPL would). ValueError only for bad arguments.
    """
    if not isinstance(code, str):
        raise ValueError(f"run_python: code must be a str, got {type(code).__name__}")
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 3600):
        raise ValueError(f"run_python: timeout_s={timeout_s!r} must be a number of seconds in (0, 3600]")
    if not (isinstance(memory_mb, int) and memory_mb >= 64):
        raise ValueError(f"run_python: memory_mb={memory_mb!r} must be an int >= 64 "
                         "(the interpreter alone needs tens of MB of address space)")
    if not (isinstance(max_output_chars, int) and max_output_chars > 0):
        raise ValueError(f"run_python: max_output_chars={max_output_chars!r} must be a positive int")
    work = tempfile.mkdtemp(prefix="rft-sandbox-")
    try:
        home = os.path.join(work, "home")  # the only writable place; stdout/stderr files sit beside it
        os.mkdir(home, 0o700)
        config = {"home": home, "read": list(_LIBRARY_DIRS), "memory": memory_mb << 20,
                  "cpu": math.ceil(timeout_s) + 1, "fsize": _FILE_BYTES, "nofile": _OPEN_FILES,
                  "landlock": _landlock_abi(), "hook": _AUDIT_HOOK, "show_last": show_last_expression}
        argv = [*_netns_prefix(), sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _CHILD,
                json.dumps(config)]
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
        out_path, err_path = os.path.join(work, "stdout"), os.path.join(work, "stderr")
        timed_out = False
        # files, not pipes: a print loop can write gigabytes in the time limit; RLIMIT_FSIZE caps them
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=home, env=env,
                                    start_new_session=True, close_fds=True)
            try:
                proc.communicate(code.encode("utf-8", "surrogatepass"), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if proc.returncode is None:  # not reaped yet, so its group id cannot have been reused
                    _kill_group(proc.pid)
                proc.wait()
        stdout = _read_head(out_path, max_output_chars)
        stderr = _read_tail(err_path, max_output_chars)
        return _result(stdout, stderr, proc.returncode, timed_out, timeout_s, memory_mb)
    finally:
        _remove_tree(work)


def isolation_layers() -> dict[str, str]:
    """The layers `run_python` uses on this machine, name -> what it does (for logs and tests)."""
    layers = {}
    prefix = _netns_prefix()
    if prefix:
        layers["network_namespace"] = " ".join(os.path.basename(a) for a in prefix[:-1])
    abi = _landlock_abi()
    if abi:
        layers["landlock"] = (f"ABI {abi}: writes only in the temp dir, reads only there and in the standard "
                              "library, no exec" + (", no TCP" if abi >= 4 else "")
                              + (", no signals out" if abi >= 6 else ""))
    layers["rlimits"] = "wall-clock timeout (process group killed), CPU, address space, file size"
    if _AUDIT_HOOK:
        layers["audit_hook"] = "Python-level: sockets, writes outside the temp dir, processes, ctypes"
    return layers


def _result(stdout: str, stderr: str, returncode: int, timed_out: bool, timeout_s: float,
            memory_mb: int) -> SandboxResult:
    # SIGXCPU: RLIMIT_CPU (set a second above the wall limit) hit first, e.g. on a slow clock
    timed_out = timed_out or returncode == -signal.SIGXCPU
    lines = [line for line in stderr.splitlines() if line.strip()]
    memory = returncode != 0 and any(line.startswith("MemoryError") for line in lines)
    if timed_out:
        error = f"timed out after {timeout_s:g}s"
    elif memory:
        error = f"MemoryError: out of memory (limit {memory_mb} MB)"
    elif returncode < 0:
        error = f"killed by signal {signal.Signals(-returncode).name}"
    elif returncode != 0:
        error = lines[-1].strip() if lines else f"exit status {returncode}"
        places = [line for line in lines if line.lstrip().startswith('File "main.py", line ')]
        if places:
            error += f" (line {places[-1].split('line ')[1].split(',')[0]})"
    else:
        error = ""
    return SandboxResult(stdout, stderr, returncode, timed_out, memory, error)


def _read_head(path: str, max_chars: int) -> str:
    with open(path, "rb") as f:
        data = f.read(4 * max_chars + 4)  # a UTF-8 character is at most 4 bytes
        more = bool(f.read(1))
    text = data.decode("utf-8", "replace")
    if more or len(text) > max_chars:
        return text[:max_chars] + "\n[output truncated]"
    return text


def _read_tail(path: str, max_chars: int) -> str:
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 4 * max_chars))
        text = f.read().decode("utf-8", "replace")
    return text if len(text) <= max_chars else "[truncated]\n" + text[-max_chars:]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # start_new_session made the child its group's leader
    except ProcessLookupError:
        pass


def _remove_tree(path: str) -> None:
    """rmtree that also gets through folders the code made unreadable (chmod 000)."""

    def retry(func, target, _exc):
        os.chmod(os.path.dirname(target), stat.S_IRWXU)
        if os.path.isdir(target) and not os.path.islink(target):
            os.chmod(target, stat.S_IRWXU)
        func(target)

    try:
        shutil.rmtree(path, onerror=retry)
    except OSError as err:
        log.warning("sandbox: could not remove %s (%s)", path, err)


_probe_lock = threading.RLock()  # the netns probe asks for the Landlock ABI
_probed: dict[str, object] = {}


def _netns_prefix() -> tuple[str, ...]:
    """`unshare` arguments that put the child in a fresh network namespace, or () where the OS
    refuses (probed once per process)."""
    with _probe_lock:
        if "netns" not in _probed:
            _probed["netns"] = _probe_netns()
        return _probed["netns"]  # type: ignore[return-value]


def _probe_netns() -> tuple[str, ...]:
    exe = shutil.which("unshare") or next((p for p in ("/usr/bin/unshare", "/bin/unshare")
                                          if os.access(p, os.X_OK)), None)
    # root may create a namespace directly; anyone else needs a user namespace too (-r)
    options = (("-n",), ("-rn",)) if os.geteuid() == 0 else (("-rn",),)
    for option in options if exe else ():
        try:
            done = subprocess.run([exe, *option, "--", sys.executable, "-I", "-S", "-c", ""],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=30, env={"PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return (exe, *option, "--")
    log.warning("sandbox: no network namespace (%s); sandboxed code is kept off the network only by "
                "the Python audit hook%s", "util-linux unshare not found" if exe is None
                else "unshare -n/-rn refused: user namespaces disabled?",
                " and Landlock's TCP rules" if _landlock_abi() >= 4 else "")
    return ()


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none (probed once per process)."""
    with _probe_lock:
        if "landlock" not in _probed:
            _probed["landlock"] = _probe_landlock()
        return _probed["landlock"]  # type: ignore[return-value]


def _probe_landlock() -> int:
    if not sys.platform.startswith("linux"):
        return 0
    try:
        import ctypes

        # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION); 444 on every architecture
        abi = ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1)
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)
