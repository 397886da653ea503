"""The Python sandbox tool: real child processes, each limit hit for real, and nothing left running."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from tether.tools import PythonSandbox


def call(code, **knobs):
    return asyncio.run(PythonSandbox(**knobs)({"code": code}))


def processes():
    """(pid, parent pid, session id) of every process, from /proc."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session
        yield int(entry), int(fields[1]), int(fields[3])


@pytest.fixture(autouse=True)
def children_before():
    """This process's children when the test starts (in a whole-suite run, Ray's and engines' are among
    them): only children started since then count as left over."""
    BEFORE[:] = [pid for pid, ppid, _ in processes() if ppid == os.getpid()]


BEFORE: list[int] = []


def leftovers(session: int | None = None) -> list[int]:
    """Children this test started, and members of `session` (the sandbox's), that still exist."""
    return [pid for pid, ppid, sid in processes() if (ppid == os.getpid() and pid not in BEFORE) or sid == session]


def test_schema():
    schema = PythonSandbox().schema()["function"]
    assert schema["name"] == "python" and schema["description"] == "Run a Python program and see what it prints"
    assert schema["parameters"]["required"] == ["code"]
    assert schema["parameters"]["properties"]["code"]["type"] == "string"


def test_normal_output_and_stdin_at_eof():
    assert call("print(sum(range(10)))") == type(call("pass"))("45\n", ok=True)
    result = call("import sys\nprint(repr(sys.stdin.read()))\nprint(__name__)")
    assert result.ok and result.output == "''\n__main__\n"


def test_exception_shows_the_traceback_after_stdout():
    result = call("def f(x):\n    return 1 / x\nprint('before')\nf(0)")
    assert not result.ok
    lines = result.output.splitlines()
    assert lines[0] == "before" and lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "ZeroDivisionError: division by zero" and '  File "<code>", line 2, in f' in lines
    assert "<string>" not in result.output  # the bootstrap's own frames are not shown


def test_syntax_error():
    result = call("print(1 +")
    assert not result.ok and "SyntaxError" in result.output and 'File "<code>", line 1' in result.output


def test_infinite_loop_is_killed_at_the_deadline():
    start = time.monotonic()
    # 2 s, not 1: a cold interpreter on a busy machine can take most of a second to print.
    result = call("import os\nprint(os.getpid(), flush=True)\nwhile True: pass", timeout_s=2)
    assert time.monotonic() - start < 4.5
    # A busy loop on an idle core spends its 2 s of CPU as the 2 s wall deadline comes: whichever limit
    # fires first stops it, and either says so.
    assert not result.ok and ("timed out after 2s" in result.output
                              or "CPU time limit of 2s exceeded" in result.output), result.output
    pid = int(result.output.split()[0])  # what it printed before it was stopped is shown
    assert not os.path.exists(f"/proc/{pid}") and leftovers(pid) == []


def test_cpu_limit():
    result = call("while True: pass", timeout_s=10, cpu_s=1)
    assert not result.ok and "CPU time limit of 1s exceeded" in result.output


@pytest.mark.parametrize("code", ["x = 'a' * 10**10", "[0] * 10**10", "x = []\nwhile True: x.append(bytearray(10**6))"])
def test_memory_blow_up_is_a_memory_error(code):
    result = call(code, memory_mb=256)
    assert not result.ok and result.output.splitlines()[-1] == "MemoryError"


@pytest.mark.parametrize("code", ["print('x' * 10**8)", "while True: print('x' * 1000)"])
def test_huge_output_is_capped_and_the_program_stopped(code):
    start = time.monotonic()
    result = call(code, max_output_bytes=1000, timeout_s=5)
    assert time.monotonic() - start < 4  # stopped for its output, not at the deadline
    assert not result.ok and "output truncated" in result.output and "was stopped" in result.output
    assert "timed out" not in result.output and len(result.output) < 1300


def test_a_bit_too_much_output_keeps_the_traceback():
    result = call("print('y' * 5000)\nraise ValueError('boom')", max_output_bytes=1000)
    assert not result.ok and "was stopped" not in result.output
    assert result.output.startswith("y" * 100) and result.output.endswith("ValueError: boom\n")
    assert "[... output truncated: " in result.output and len(result.output) < 1100


def test_fork_bomb_ends_and_leaves_no_process():
    result = call("import os\nprint(os.getpid(), flush=True)\nwhile True: os.fork()", timeout_s=2)
    assert not result.ok and "PermissionError: the sandbox does not allow os.fork" in result.output
    pid = int(result.output.split()[0])
    assert leftovers(pid) == []


@pytest.mark.parametrize("code, refused", [
    ("import os\nos.system('echo hi')", "os.system"),
    ("import subprocess\nsubprocess.run(['echo', 'hi'])", "subprocess.Popen"),
    ("import os\nos.execv('/bin/echo', ['echo', 'hi'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/echo', ['echo', 'hi'], {})", "os.posix_spawn"),
    ("import os\nos.kill(os.getppid(), 9)", "os.kill"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "socket.getaddrinfo"),
    ("import socket\nsocket.socket().connect(('127.0.0.1', 9))", "socket.__new__"),
    ("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')", "urllib.Request"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "resource.setrlimit"),
])
def test_processes_network_and_signals_are_refused(code, refused):
    result = call(code)
    assert not result.ok and f"PermissionError: the sandbox does not allow {refused}" in result.output
    assert "hi" not in result.output.splitlines()


def test_ctypes_is_refused():
    result = call("import ctypes")
    assert not result.ok and "ImportError: the sandbox does not allow importing ctypes" in result.output


def test_writing_outside_the_working_directory_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for code in (f"open({str(target)!r}, 'w')", f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import os\nos.symlink({str(tmp_path)!r}, 'link')\nopen('link/escaped.txt', 'w')"):
        result = call(code)
        assert not result.ok and "PermissionError: the sandbox does not allow open" in result.output, code
    assert not target.exists()


def test_the_working_directory_is_writable_and_deleted_after():
    code = ("import os, tempfile\nopen('a.txt', 'w').write('hello')\nos.makedirs('d/e')\n"
            "with tempfile.NamedTemporaryFile('w') as f:\n    f.write('x')\n"
            "print(open('a.txt').read(), os.getcwd())")
    result = call(code)
    assert result.ok and result.output.startswith("hello ")
    assert not os.path.exists(result.output.split()[1])


def test_file_size_limit():
    result = call("open('big', 'wb').write(b'x' * (2 << 20))", max_file_mb=1)
    assert not result.ok and "File too large" in result.output


def test_nothing_is_inherited_from_the_environment(monkeypatch):
    monkeypatch.setenv("TETHER_TEST_SECRET", "s3cret")
    result = call("import os\nprint(sorted(os.environ))")
    assert result.ok and "TETHER_TEST_SECRET" not in result.output and "'PATH'" in result.output


def test_concurrent_calls_are_limited_independently():
    tool = PythonSandbox(timeout_s=1.5)

    async def many():
        codes = [f"print({i} * 2)" if i % 2 else "while True: pass" for i in range(8)]
        return await asyncio.gather(*(tool({"code": code}) for code in codes))

    start = time.monotonic()
    results = asyncio.run(many())
    assert time.monotonic() - start < 4
    for i, result in enumerate(results):
        if i % 2:
            assert result.ok and result.output == f"{i * 2}\n"
        else:
            assert not result.ok and "timed out after 1.5s" in result.output
    assert leftovers() == []


def test_a_cancelled_call_leaves_no_process():
    async def cancel():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(PythonSandbox(timeout_s=30)({"code": "while True: pass"}), 0.5)

    asyncio.run(cancel())
    assert leftovers() == []


def test_site_packages_can_be_imported_when_asked():
    pytest.importorskip("numpy")
    code = "import numpy as np\nprint(int(np.arange(5).sum()))"
    assert "ModuleNotFoundError" in call(code).output  # -S by default: the standard library only
    result = call(code, site_packages=True)  # numpy survives ctypes being refused
    assert result.ok and result.output == "10\n"


def _nobody_can_run(python: str) -> bool:
    return os.geteuid() == 0 and os.path.exists(python) and subprocess.run(
        [python, "-I", "-S", "-c", "pass"], user=65534, group=65534, extra_groups=[], cwd="/",
        capture_output=True).returncode == 0


@pytest.mark.skipif(not _nobody_can_run("/usr/bin/python3"), reason="needs root and a Python nobody can run")
def test_root_runs_the_program_as_nobody():
    result = call("import os\nprint(os.getuid(), os.getgid(), os.getgroups())\nopen('x', 'w')",
                  python="/usr/bin/python3")
    assert result.ok and result.output == "65534 65534 []\n"
    # an interpreter nobody cannot start (as this venv's, under /root) still runs, as the caller
    assert call("import os\nprint(os.getuid())", python=sys.executable).ok
