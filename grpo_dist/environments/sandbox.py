"""Run untrusted Python (the model's tool calls) in a sandbox process, many calls at once.

Built on the reward workers' isolation (grpo_dist/rewards/grading.py: a fresh interpreter, no fork of the trainer,
its own session so that one SIGKILL of the process group ends everything it started) and tightened for code that a
model wrote:

- one fresh process per call (`python -I -B`: no user site, no PYTHONPATH, no .pyc writes), in a new session;
- resource limits set by the runner before any user code: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS),
  file size (RLIMIT_FSIZE), open files, no core dumps, processes (RLIMIT_NPROC, enforced once the runner is not
  root);
- no network: a network namespace of its own (root: unshare(CLONE_NEWNET) and then setuid to nobody; others: a
  user namespace with the same uid and a network namespace), and in every case an audit hook that refuses sockets;
- the audit hook (sys.addaudithook, which Python code cannot remove) also refuses new processes (fork, exec,
  subprocess, os.system, posix_spawn), signals (os.kill / killpg: the parent is out of reach), ctypes, reading files
  outside the sandbox folder and the interpreter's own library folders, and any write, rename or removal outside the
  sandbox folder;
- a scrubbed environment (PATH, HOME = the sandbox folder, LANG, one thread per math library): no secrets;
- a temporary working folder per call, removed afterwards;
- output (stdout and stderr together) read up to max_output_chars; a call that prints more is stopped at once and
  its output truncated (a 100 MB print or a never-ending one costs max_output_chars, not memory);
- a wall-time limit per call (the parent kills the process group), and the caller's per-episode budget.

Every way a call can fail ends as a ToolResult with error set (counted by the environment) and an output that says
what happened; the parent never raises for the code's sake. Not a security boundary against a determined attacker
with a kernel exploit: run training in a container when the code is hostile by design.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534
HARD_CAP_FACTOR = 16  # a call that prints more than this x (4 x max_output_chars) bytes is stopped

# Runs in the sandbox process: limits, namespaces, privilege drop, audit hook, then the code from stdin. Kept as
# source (not a module of the package): the sandbox starts with -I, so nothing of grpo_dist is importable there.
RUNNER = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
box = cfg["dir"]
for lim, v in (("RLIMIT_CPU", cfg["cpu_s"]), ("RLIMIT_AS", cfg["memory_bytes"]), ("RLIMIT_FSIZE", cfg["file_bytes"]),
               ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", cfg["nproc"])):
    try:
        resource.setrlimit(getattr(resource, lim), (v, v))
    except (ValueError, OSError):
        pass
isolated = False
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() == 0:
        isolated = libc.unshare(0x40000000) == 0          # CLONE_NEWNET
        if cfg["drop"]:  # nobody can read the interpreter's library: run as nobody
            os.setgroups([]); os.setgid(cfg["nobody"]); os.setuid(cfg["nobody"])
    else:
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(0x10000000 | 0x40000000) == 0:    # CLONE_NEWUSER | CLONE_NEWNET
            isolated = True
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                try:
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
                except OSError:
                    pass
    del ctypes, libc
except Exception:
    pass
import subprocess, _posixsubprocess  # loaded now, so that user code's import finds them; spawning stays refused
def refused_spawn(*args, **kwargs):
    raise PermissionError("sandbox: starting processes is not allowed")
_posixsubprocess.fork_exec = refused_spawn
os.chdir(box)
real = os.path.realpath
roots = tuple(real(p) for p in cfg["read_roots"] if p) + (real(box),)
box_real = real(box)
READ_OK = ("/dev/null", "/dev/urandom")

def inside(path, where):
    try:
        if isinstance(path, int):
            return True
        p = real(os.fsdecode(path))
    except Exception:
        return False
    return any(p == w or p.startswith(w + os.sep) for w in where)

REFUSED = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
           "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
           "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "os.chroot",
           "sys.remote_exec"}
PATH_EVENTS = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
               "os.symlink", "os.link", "os.rename", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def hook(event, args):
    # ctypes may be imported (sympy reads sizeof(c_long)) but not used: no symbol lookup, call or raw memory
    if event in REFUSED or (event.startswith("ctypes.") and event != "ctypes.dlopen"):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].split(".")[0] in ("cffi", "_posixshmem"):
        raise ImportError(f"sandbox: import of {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = bool(flags & WRITE_FLAGS) if isinstance(flags, int) and flags >= 0 else \
            any(c in str(mode or "r") for c in "wax+")
        if writes and not inside(path, (box_real,)):
            raise PermissionError(f"sandbox: writing {path!r} is not allowed (only inside the working folder)")
        if not writes and path not in READ_OK and not inside(path, roots):
            raise PermissionError(f"sandbox: reading {path!r} is not allowed (only inside the working folder)")
    elif event in ("os.listdir", "os.scandir") and not inside(args[0] if args[0] is not None else ".", roots):
        raise PermissionError(f"sandbox: listing {args[0]!r} is not allowed")
    elif event in PATH_EVENTS:
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not inside(a, (box_real,)):
                raise PermissionError(f"sandbox: {event} outside the working folder is not allowed")

code = sys.stdin.read()
sys.stdin.close()
import posix
_exit = os._exit
def refused_exit(*args):
    raise PermissionError("sandbox: os._exit is not allowed (end the code normally)")
os._exit = posix._exit = refused_exit
os.abort = posix.abort = refused_exit
sys.stdin = open(os.devnull)
sys.addaudithook(hook)
del hook
import ast, traceback
try:
    tree = ast.parse(code, "<tool>")
    tail = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):   # like a notebook: the last expression is shown
        tail = ast.Expression(tree.body.pop().value)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(tree, "<tool>", "exec"), scope)
    if tail is not None:
        value = eval(compile(tail, "<tool>", "eval"), scope)
        if value is not None:
            print(repr(value))
except SystemExit as e:
    sys.stdout.flush()
    _exit(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
except BaseException:
    sys.stdout.flush()
    kind, value, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename != "<tool>":
        tb = tb.tb_next
    sys.stderr.write("".join(traceback.format_exception(kind, value, tb)))
    sys.stderr.flush()
    _exit(1)
sys.stdout.flush()
sys.stderr.flush()
_exit(0)
'''


@dataclass
class SandboxLimits:
    timeout_s: float = 5.0          # wall time per call
    cpu_s: int = 5                  # RLIMIT_CPU
    memory_mb: int = 1024           # RLIMIT_AS
    file_mb: int = 16               # RLIMIT_FSIZE: the largest file the code may write
    max_output_chars: int = 1024    # stdout + stderr kept; more stops the call
    nproc: int = 64                 # RLIMIT_NPROC (not enforced for root: the runner drops to nobody first)
    workers: int = 4                # calls run at once


@dataclass
class ToolResult:
    output: str                     # what the call printed (truncated), or what went wrong
    error: str | None = None        # None: ran and exited 0; else "exception", "timeout", "output_limit", "exit",
                                    # "killed", "start"
    seconds: float = 0.0
    truncated: bool = False
    pid: int | None = None          # the sandbox process (its session and process group): gone when this returns


def _env(box: str) -> dict:
    """The scrubbed environment: nothing of the trainer's (tokens, keys, paths) reaches the code."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": box, "TMPDIR": box, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _world_readable(paths: list[str]) -> bool:
    """Whether an unprivileged user (nobody) can reach these folders: every folder above them traversable by
    others. A root-owned Python under /root is not, and then the runner stays root (the audit hook guards files)."""
    import stat
    for p in paths:
        p = os.path.realpath(p)
        while True:
            try:
                if not os.stat(p).st_mode & stat.S_IXOTH:
                    return False
            except OSError:
                return False
            if p == os.path.dirname(p):
                break
            p = os.path.dirname(p)
    return True


def _read_roots() -> list[str]:
    """Folders the code may read: the interpreter's library (stdlib, site-packages: imports need them)."""
    import sysconfig
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    paths.update(v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib"))
    return sorted(p for p in paths if p)


class _Call:
    """One running sandbox process and what it printed so far."""

    def __init__(self, code: str, limits: SandboxLimits, deadline_s: float):
        self.box = tempfile.mkdtemp(prefix="grpo_tool_")
        self.t0 = time.monotonic()
        self.deadline = self.t0 + max(0.0, deadline_s)
        self.limits, self.out, self.truncated, self.error = limits, bytearray(), False, None
        self.seen = 0  # bytes printed in all
        roots = _read_roots()
        drop = os.geteuid() == 0 and _world_readable(roots + [self.box])
        if drop:  # the runner becomes nobody: its folder must be its own
            os.chown(self.box, NOBODY, NOBODY)
        cfg = dict(drop=drop, dir=self.box, cpu_s=int(limits.cpu_s), memory_bytes=int(limits.memory_mb) << 20,
                   file_bytes=int(limits.file_mb) << 20, nproc=int(limits.nproc), nobody=NOBODY,
                   read_roots=roots)
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", RUNNER, json.dumps(cfg)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=self.box, env=_env(self.box),
                close_fds=True, start_new_session=True)
        except OSError as e:
            self.proc, self.error = None, "start"
            self.out += f"the sandbox did not start: {e}".encode()
            return
        self.pgid = self.proc.pid  # the session leader's pid names its process group
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(code.encode("utf-8", "replace"))
            self.proc.stdin.close()
        except OSError:
            pass  # it died already: its exit status says how
        os.set_blocking(self.fd, False)

    @property
    def fd(self) -> int:
        assert self.proc is not None and self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def read(self) -> bool:
        """Take what the process printed; True at end of output, or once it printed more than the hard cap
        (HARD_CAP_FACTOR x max_output_chars: a 100 MB or never-ending print is stopped, not buffered)."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return False
        except OSError:
            return True
        if not data:
            return True
        self.out += data
        self.seen += len(data)
        keep = self.limits.max_output_chars * 4  # bytes: up to 4 per character; the tail is what is shown
        if len(self.out) > 2 * keep:
            del self.out[:len(self.out) - keep]
        if self.seen > HARD_CAP_FACTOR * keep:
            self.truncated, self.error = True, "output_limit"
            return True
        return False

    def finish(self, timed_out: bool) -> ToolResult:
        """Kill the whole process group (the code's children too), reap, remove the folder, say what happened."""
        code = None
        if self.proc is not None:
            if not timed_out and self.error is None:  # end of output: let it exit by itself (its status counts)
                try:
                    self.proc.wait(timeout=max(0.05, min(1.0, self.deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except OSError:
                pass
            try:
                code = self.proc.wait(timeout=5) if self.proc.returncode is None else self.proc.returncode
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
                pass
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        shutil.rmtree(self.box, ignore_errors=True)
        text = self.out.decode("utf-8", "replace")
        if self.seen > len(self.out) or len(text) > self.limits.max_output_chars:  # the end of the output is kept
            text = f"[... {self.seen - len(text[-self.limits.max_output_chars:].encode())} bytes cut]\n" \
                   f"{text[-self.limits.max_output_chars:]}"
            self.truncated = True
        if timed_out and self.error is None:
            self.error = "timeout"
        if self.error is None and code != 0:
            self.error = "exception" if code == 1 else ("killed" if code is not None and code < 0 else "exit")
        note = {"timeout": f"[stopped: the code ran past its {self.limits.timeout_s:g} s time limit]",
                "output_limit": f"[stopped: the code printed more than "
                                f"{HARD_CAP_FACTOR * 4 * self.limits.max_output_chars} bytes]",
                "killed": f"[the code was killed by signal {-(code or 0)} (CPU or memory limit)]",
                "exit": f"[the code exited with status {code}]"}.get(self.error or "")
        if note:
            text = f"{text.rstrip()}\n{note}".lstrip("\n")
        return ToolResult(text, self.error, time.monotonic() - self.t0, self.truncated,
                          None if self.proc is None else self.pgid)


def run_python(codes: list[str], limits: SandboxLimits, budgets_s: list[float] | None = None) -> list[ToolResult]:
    """Run each code in its own sandbox, up to limits.workers at once; budgets_s: each call's wall time (default
    limits.timeout_s; the per-episode budget caps it). Never raises for the code's sake."""
    budgets = budgets_s if budgets_s is not None else [limits.timeout_s] * len(codes)
    results: list[ToolResult | None] = [None] * len(codes)
    waiting = list(range(len(codes)))
    running: dict[int, _Call] = {}
    while waiting or running:
        while waiting and len(running) < max(1, limits.workers):
            i = waiting.pop(0)
            call = _Call(codes[i], limits, min(limits.timeout_s, budgets[i]))
            if call.proc is None:
                results[i] = call.finish(False)
            else:
                running[i] = call
        if not running:
            continue
        now = time.monotonic()
        wait = max(0.0, min(c.deadline for c in running.values()) - now)
        ready, _, _ = select.select([c.fd for c in running.values()], [], [], min(wait, 0.5))
        for i, call in list(running.items()):
            done = call.read() if call.fd in ready else False
            late = time.monotonic() >= call.deadline
            if done or late:
                results[i] = call.finish(timed_out=late and not done)
                del running[i]
    return [r if r is not None else ToolResult("", "start") for r in results]
