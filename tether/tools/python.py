"""A Python tool: run a program in a separate, limited process and show the model what it printed.

Each call starts `python -I -B -S -X utf8 -c <bootstrap>` in a new session (its own process group), in a
fresh temporary working directory that is deleted afterwards, with a minimal environment (PATH, and
HOME/TMPDIR pointing at the working directory; nothing inherited, so no secrets) and the program on
stdin (read whole by the bootstrap, so the program's own reads of stdin get EOF). The output is
stdout, then stderr (a traceback's last lines included, as a REPL user sees them).

What is enforced, whatever the program does (the separate process and the kernel's limits):
- wall clock: at `timeout_s` the whole process group is killed (SIGKILL); "timed out after Ns";
- CPU time (RLIMIT_CPU), address space (RLIMIT_AS: a big allocation is a MemoryError), size of a file
  written (RLIMIT_FSIZE), no core dumps; the limits are set by the bootstrap before the program runs;
- output: the parent reads the pipes incrementally and keeps at most `max_output_bytes` (the head of
  stdout, the tail of stderr), saying how much was cut; a program that prints 1 MiB beyond the cap is
  killed, so a huge print costs the caller neither memory nor time (only output cut short by that
  kill makes ok=False; a program that exits 0 with a trimmed output is still ok);
- the caller is never taken down: every failure of the program is the tool's output with ok=False, and
  a cancelled call kills the program too. Only a sandbox that cannot start at all raises ToolFailure
  (the sample is retried, then masked: tether/rollout/failures.py).

What is refused by an audit hook (`sys.addaudithook`, installed before the program runs; the program
sees "PermissionError: the sandbox does not allow os.system (no new processes)"): os.system,
subprocess, os.fork/forkpty, os.exec*, os.posix_spawn, pty, os.kill/killpg, changing rlimits; sockets
other than AF_UNIX, connect/bind/DNS/sendto, urllib/http.client and the other network clients; opening
a file for writing, deleting, renaming, chmod... outside the working directory (/dev/null excepted);
importing ctypes (an ImportError, which libraries such as numpy expect).

Not guaranteed. An audit hook is not a security boundary: Python code can reach the same system calls
without raising an event (`_posixsubprocess.fork_exec`, `os.open` with `dir_fd`, a re-created builtin
module) or tamper with the hook's module. Reading files is not restricted: the program can read what the
user running it can. RLIMIT_FSIZE bounds one file, not the disk. There is no network namespace (the
hook is all that stops sockets). Privileges: when the caller is root the program runs as nobody (65534)
if that user can start the interpreter (not the case for a Python under /root, as in this repository's
development machine, so there it runs as root), and only then do RLIMIT_NPROC (not enforced for root,
and not set for a non-root caller, whose own processes the kernel would count), file permissions and
signal permissions protect the caller. Otherwise a program that gets past the hook can fork without
limit, and a child that calls setsid escapes the group kill. For policies that may learn to attack the
sandbox, or untrusted code at scale, run this tool inside a container or nsjail/bubblewrap (seccomp,
cgroups, a network namespace).

Overhead: a trivial program's round trip is about 30 ms (20-50 ms measured on a loaded 2-core machine,
Python 3.11, -S; a bare interpreter start is 12 ms of it). site_packages=True adds the site import
(numpy's import is ~250 ms on its own).
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

from tether.errors import ToolFailure
from tether.tools.base import Tool, ToolResult

NOBODY = 65534
FLOOD_BYTES = 1 << 20
"""Output read beyond the cap before the program is killed (reading it costs little, and lets a
program that prints a bit too much still finish with its traceback)."""

_BOOTSTRAP = r'''
import os, resource, sys

def limit(memory, cpu, fsize, nproc):
    for res, soft, hard in ((resource.RLIMIT_AS, memory, memory), (resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NPROC, nproc, nproc),
                            (resource.RLIMIT_CORE, 0, 0)):
        if hard < 0:  # not set
            continue
        current = resource.getrlimit(res)[1]
        if current != resource.RLIM_INFINITY:  # without privileges a hard limit can only go down
            hard = min(hard, current)
        resource.setrlimit(res, (min(soft, hard), hard))

NETWORK = ("socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
           "socket.getnameinfo", "socket.sendto", "socket.sendmsg", "urllib.Request", "http.client.connect",
           "ftplib.connect", "smtplib.connect", "poplib.connect", "imaplib.open", "nntplib.connect",
           "telnetlib.Telnet.open", "webbrowser.open")
REFUSED = {**dict.fromkeys(("os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                            "subprocess.Popen", "pty.spawn"), "no new processes"),
           **dict.fromkeys(("os.kill", "os.killpg", "signal.pthread_kill"), "no signals to processes"),
           **dict.fromkeys(("resource.setrlimit", "resource.prlimit"), "the limits are fixed"),
           "ctypes.dlopen": "no native libraries", **dict.fromkeys(NETWORK, "no network")}
# event -> (index of a path argument, index of its dir_fd argument or None), from the audit events table
WRITES = {"open": ((0, None),), "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
          "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
          "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.truncate": ((0, None),), "os.utime": ((0, 3),),
          "os.setxattr": ((0, None),), "os.removexattr": ((0, None),), "shutil.rmtree": ((0, 1),)}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
AF_UNIX = 1  # local socket pairs (asyncio's loop makes one); the same number on Linux and macOS

def writable(workdir, path, dir_fd):
    if isinstance(path, int):  # an open descriptor: checked when it was opened (or stdout/stderr)
        return True
    path = os.fsdecode(path)
    if dir_fd is not None and dir_fd != -1 and not os.path.isabs(path):
        path = os.path.join(os.readlink("/proc/self/fd/%d" % dir_fd), path)
    path = os.path.realpath(path)  # through symlinks and /proc/self/fd links
    return path == workdir or path.startswith(workdir + os.sep) or path == os.devnull  # (O_TMPFILE opens the dir)

def make_hook(workdir):
    def hook(event, args):
        if event in REFUSED:
            raise PermissionError("the sandbox does not allow %s (%s)" % (event, REFUSED[event]))
        if event == "socket.__new__" and args[1] not in (-1, AF_UNIX):
            raise PermissionError("the sandbox does not allow %s (no network)" % event)
        if event == "import" and args[0] in ("ctypes", "_ctypes"):
            raise ImportError("the sandbox does not allow importing %s" % args[0])  # libraries expect this
        if event in WRITES and (event != "open" or args[2] & WRITE_FLAGS):
            for path, dir_fd in WRITES[event]:
                if not writable(workdir, args[path], None if dir_fd is None else args[dir_fd]):
                    raise PermissionError("the sandbox does not allow %s of %r (only files under the"
                                          " working directory can be written)" % (event, args[path]))
    return hook

def report(err, source):
    try:  # imported only now: a successful run need not pay for traceback's imports
        import linecache, traceback
        linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
        shown = traceback.TracebackException(type(err), err, err.__traceback__)
        # without this bootstrap's frames (run, hook): the model should see its own code and the library's
        shown.stack = traceback.StackSummary.from_list([f for f in shown.stack if f.filename != "<string>"])
        sys.stderr.write("".join(shown.format()))
    except BaseException:
        os.write(2, ("%s: %s\n" % (type(err).__name__, err)).encode("utf-8", "replace"))

def run(source):
    main = type(sys)("__main__")  # the program's own module, so pickle and __name__ checks work
    sys.modules["__main__"] = main
    main.__dict__["exit"] = main.__dict__["quit"] = sys.exit  # what site would add
    try:
        exec(compile(source, "<code>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as err:
        if isinstance(err, MemoryError):
            main.__dict__.clear()  # free what it held, so the traceback can be printed
        report(err, source)
        return 1
    return 0

source = sys.stdin.buffer.read().decode("utf-8", "replace")
limit(*map(int, sys.argv[1:5]))
sys.addaudithook(make_hook(os.path.realpath(os.getcwd())))
sys.exit(run(source))
'''


class PythonSandbox(Tool):
    name = "python"
    description = "Run a Python program and see what it prints"
    parameters = {"type": "object", "properties": {"code": {
        "type": "string", "description": "a whole Python program; use print() to show results"}},
        "required": ["code"]}

    def __init__(self, timeout_s: float = 5.0, cpu_s: float | None = None, memory_mb: int = 512,
                 max_output_bytes: int = 4096, max_file_mb: float = 1, max_processes: int = 64,
                 python: str = sys.executable, site_packages: bool = False, drop_privileges: bool = True):
        self.timeout_s = timeout_s
        """Wall-clock limit; the process group is killed when it passes."""
        self.cpu_s = math.ceil(timeout_s if cpu_s is None else cpu_s)
        """CPU seconds (RLIMIT_CPU, whole seconds); threads on several cores can use it before the wall limit."""
        self.memory_mb = memory_mb
        """Address space (RLIMIT_AS); an allocation past it is a MemoryError in the program."""
        self.max_output_bytes = max_output_bytes
        """Output shown to the model (stdout and stderr together); the rest is cut, with a note."""
        self.max_file_mb = max_file_mb
        """Largest file the program can write (RLIMIT_FSIZE); writing more is an OSError."""
        self.max_processes = max_processes
        """RLIMIT_NPROC (threads count), set when the program runs as nobody: the kernel counts all the
        user's processes (all sandboxes', when they run as nobody; the caller's own, were it set for the
        caller's user) and ignores the limit for root."""
        self.python = python
        """The interpreter that runs the program."""
        self.site_packages = site_packages
        """Let the program import the interpreter's installed packages (numpy, sympy...); slower start."""
        self.drop_privileges = drop_privileges
        """When the caller is root, run the program as nobody if nobody can start the interpreter."""
        if min(timeout_s, self.cpu_s, memory_mb, max_output_bytes, max_file_mb, max_processes) <= 0:
            raise ValueError("the sandbox's limits must be positive")

    async def run(self, code: str) -> ToolResult:
        user = None
        if self.drop_privileges and os.geteuid() == 0 and await asyncio.to_thread(_can_run_as, self.python, NOBODY):
            user = NOBODY
        workdir = tempfile.mkdtemp(prefix="tether-python-")
        try:
            if user is not None:
                os.chown(workdir, user, user)
            ids: dict[str, Any] = {} if user is None else {"user": user, "group": user, "extra_groups": []}
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self._command(self.max_processes if user else -1), stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=_environment(workdir),
                    start_new_session=True, **ids)  # its own session and group: killpg reaches all it started
            except OSError as err:  # no process (out of PIDs or memory, no interpreter): not the program's doing
                raise ToolFailure(f"tool {self.name}: the sandbox could not start {self.python}: {err}") from err
            try:
                return await self._communicate(proc, code)
            finally:
                if proc.returncode is None:  # cancelled, or an error here: leave nothing running
                    _kill_group(proc.pid)
                    await asyncio.wait_for(proc.wait(), 5)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _command(self, nproc: int) -> list[str]:
        limits = (int(self.memory_mb * (1 << 20)), self.cpu_s, int(self.max_file_mb * (1 << 20)), nproc)
        return [self.python, "-I", "-B", "-X", "utf8", *([] if self.site_packages else ["-S"]),
                "-c", _BOOTSTRAP, *map(str, limits)]

    async def _communicate(self, proc: asyncio.subprocess.Process, code: str) -> ToolResult:
        """Send the program, read its output within the caps and the deadline, and say how it ended."""
        out, err = _Capture(self.max_output_bytes, tail=False), _Capture(self.max_output_bytes, tail=True)
        flooded = timed_out = False
        stdin, stdout, stderr = proc.stdin, proc.stdout, proc.stderr
        assert stdin is not None and stdout is not None and stderr is not None  # run() made all three pipes

        async def send() -> None:
            try:
                stdin.write(code.encode("utf-8", "replace"))
                await stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass  # it died before reading everything: its exit status says why
            finally:
                stdin.close()

        async def pump(stream: asyncio.StreamReader, capture: _Capture) -> None:
            nonlocal flooded
            while chunk := await stream.read(1 << 16):
                capture.add(chunk)
                if not flooded and out.seen + err.seen > self.max_output_bytes + FLOOD_BYTES:
                    flooded = True
                    _kill_group(proc.pid)  # then read on to EOF, which comes as soon as it is dead

        # Tasks awaited by hand rather than wait_for(gather(...)): a cancelled gather logs its exception.
        tasks = [asyncio.ensure_future(job) for job in (send(), pump(stdout, out), pump(stderr, err))]
        exited = asyncio.ensure_future(proc.wait())
        try:
            done, pending = await asyncio.wait([*tasks, exited], timeout=self.timeout_s,
                                               return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # an error in this code, not the program's: Tool.__call__ reports it
            if pending:
                timed_out = True
                _kill_group(proc.pid)
                await asyncio.wait_for(asyncio.shield(exited), 5)
        finally:
            for task in (*tasks, exited):
                task.cancel()
            await asyncio.gather(*tasks, exited, return_exceptions=True)
        text = _compose(out, err, self.max_output_bytes, flooded or timed_out)
        assert proc.returncode is not None  # it exited (waited for above, after the kill when it timed out)
        note = self._ending(proc.returncode, timed_out, flooded, bool(err.seen))
        if note and text and not text.endswith("\n"):
            text += "\n"
        return ToolResult(text + note, ok=proc.returncode == 0 and not (timed_out or flooded))

    def _ending(self, returncode: int, timed_out: bool, flooded: bool, said_why: bool) -> str:
        """A line saying how the program ended, when its own output does not."""
        if timed_out:
            return f"error: timed out after {self.timeout_s:g}s (the program was stopped)"
        if flooded:
            return f"error: the program printed more than {FLOOD_BYTES >> 20} MiB and was stopped"
        if returncode == -signal.SIGXCPU:
            return f"error: CPU time limit of {self.cpu_s}s exceeded (the program was stopped)"
        if returncode < 0:
            try:
                return f"error: the program was killed by {signal.Signals(-returncode).name}"
            except ValueError:
                return f"error: the program was killed by signal {-returncode}"
        return f"error: exit status {returncode}" if returncode > 0 and not said_why else ""


class _Capture:
    """One output stream as it is read: how many bytes came, and the first (or last) `keep` of them."""

    def __init__(self, keep: int, tail: bool):
        self.keep, self.tail = keep, tail
        self.data = bytearray()
        self.seen = 0

    def add(self, chunk: bytes) -> None:
        self.seen += len(chunk)
        if self.tail:
            self.data += chunk
            del self.data[:-self.keep]
        elif len(self.data) < self.keep:
            self.data += chunk[:self.keep - len(self.data)]


def _compose(out: _Capture, err: _Capture, cap: int, stopped: bool) -> str:
    """stdout's head then stderr's tail (where a traceback ends), within `cap` bytes, saying what was cut.

    stderr gets at least half of the cap when both are long: the exception is what the model needs."""
    out_shown, err_shown = out.seen, err.seen
    if out.seen + err.seen > cap:
        err_shown = min(err.seen, max(cap // 2, cap - out.seen))
        out_shown = min(out.seen, cap - err_shown)
    cut = out.seen - out_shown + err.seen - err_shown
    text = out.data[:out_shown].decode("utf-8", "replace")
    if out.seen > out_shown or err.seen > err_shown:
        more = ", and more that was not read" if stopped else ""
        text += f"\n[... output truncated: {cut} bytes cut{more} ...]\n"
    return text + err.data[len(err.data) - err_shown:].decode("utf-8", "replace")


def _environment(workdir: str) -> dict[str, str]:
    # Nothing inherited (no tokens or keys). -I makes the interpreter ignore PYTHON* variables, so
    # PYTHONIOENCODING is belt and braces next to -X utf8; one BLAS/OpenMP thread each, since many
    # sandboxes run at once next to the rollout.
    return {"PATH": os.defpath, "PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8", "HOME": workdir,
            "TMPDIR": workdir, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the session's group: the program and anything it started
    except (ProcessLookupError, PermissionError):
        pass  # already gone


@functools.lru_cache(maxsize=None)
def _can_run_as(python: str, uid: int) -> bool:
    """Whether `uid` can start `python` (it cannot when the interpreter lives under /root)."""
    try:
        return subprocess.run([python, "-I", "-S", "-c", "pass"], user=uid, group=uid, extra_groups=[], cwd="/",
                              env={"PATH": os.defpath}, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False

