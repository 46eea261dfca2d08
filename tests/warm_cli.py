"""Run ``python -m shardckpt ARGV``, or torchrun's agent, in a process forked from a warm interpreter.

A fresh ``python -m shardckpt`` spends ~2.5 s of CPU importing torch before it does
anything; a test of what a running command does (a signal in the middle of a
conversion, two runs racing for one DST, a memory cap, a user the files refuse) needs
a process of its own, not a fresh interpreter. These processes fork from the fork
server that ``harness`` ranks fork from, which imported torch and shardckpt once (as
DataLoader workers fork after ``import torch``), then run the CLI's own entry point,
``shardckpt.__main__.main``, with the argv, environment, working directory and
stdout/stderr asked for, and end with its exit code, atexit handlers run.

What a fresh interpreter does before ``main`` (start-up and the signals that arrive
while torch is imported) is tested on real ``python -m shardckpt`` processes:
tests/unit/test_startup.py and tests/e2e/test_interruptions.py's Ctrl-C tests.

``torchrun`` (``start_torchrun``, ``run_torchrun``) forks torchrun's agent the same way:
its own entry point, ``torch.distributed.run.main``, with the arguments given. Only the
agent's import of torch is saved (~1.4 s of CPU a launch); the ranks it starts are what
torchrun starts for any user, fresh interpreters (``python -u -m shardckpt ...``, or
the program after ``--no-python``), with the agent's environment.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import harness


def _statm_bytes() -> int:
    """Return this process's address space in bytes (VmSize)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def cap_address_space(budget_bytes: int) -> None:
    """Set RLIMIT_AS to what this process maps now plus ``budget_bytes`` (a ``setup``)."""
    import resource

    limit = _statm_bytes() + budget_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def close_stream(fd: int) -> None:
    """Start as an interpreter started with descriptor ``fd`` (1 or 2) closed (a ``setup``): ``>&-``, ``2>&-``."""
    os.close(fd)
    setattr(sys, "stdout" if fd == 1 else "stderr", None)


def stream_to(fd: int, path: str) -> None:
    """Send descriptor ``fd`` (1 or 2) to ``path`` (a ``setup``): ``>/dev/full``, ``2>/dev/full``."""
    target = os.open(path, os.O_WRONLY)
    os.dup2(target, fd)
    os.close(target)


def drop_to_nobody() -> None:
    """Become ``nobody``:``nogroup`` with no other groups (a ``setup``; needs root)."""
    import grp
    import pwd

    os.setgroups([])
    os.setgid(grp.getgrnam("nogroup").gr_gid)
    os.setuid(pwd.getpwnam("nobody").pw_uid)


def _shardckpt(argv: list[str]) -> None:
    """Run ``python -m shardckpt ARGV``'s entry point."""
    sys.argv = [str(Path(sys.modules["shardckpt"].__file__).with_name("__main__.py")), *argv]
    from shardckpt.__main__ import main

    main()


def _torchrun(argv: list[str]) -> None:
    """Run ``torchrun ARGV``'s entry point (the console script calls ``sys.exit(main())``)."""
    sys.argv = ["torchrun", *argv]
    from torch.distributed.run import main

    sys.exit(main())


_PROGRAMS = {"shardckpt": _shardckpt, "torchrun": _torchrun}


def _print_uncaught(exc: BaseException) -> None:
    """Print ``exc`` as the interpreter prints an uncaught exception, without this module's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def _child(program, argv, env, cwd, out_path, err_path, setup) -> None:
    """Run ``program`` (``_PROGRAMS``) as a started interpreter would; never return."""
    code: int = 1
    try:
        for fd, path in ((1, out_path), (2, err_path)):
            target = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        added = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [p for p in added if p not in sys.path]
        # The fork server ignores SIGINT; a started interpreter has Python's handler.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if setup is not None:
            setup[0](*setup[1:])
        try:
            _PROGRAMS[program](argv)
            code = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
    except BaseException as exc:  # what the interpreter would print for an uncaught exception
        _print_uncaught(exc)
        code = 1
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


class WarmProcess:
    """A started command: the subset of ``subprocess.Popen`` the tests use (text output)."""

    def __init__(
        self,
        argv: list,
        env: dict[str, str] | None = None,
        cwd: Path | str | None = None,
        setup: tuple[Callable, ...] | None = None,
        program: str = "shardckpt",
    ) -> None:
        argv = [str(a) for a in argv]
        self.args = (
            ["python", "-m", "shardckpt", *argv] if program == "shardckpt" else [program, *argv]
        )
        self._dir = tempfile.mkdtemp(prefix="shardckpt-warm-")
        self._out, self._err = (os.path.join(self._dir, n) for n in ("out", "err"))
        for path in (self._out, self._err):
            open(path, "w").close()
        env = dict(os.environ if env is None else env)
        env.setdefault("OMP_NUM_THREADS", "1")
        ctx = harness.fork_server()
        self._proc = ctx.Process(
            target=_child,
            args=(program, argv, env, str(cwd or os.getcwd()), self._out, self._err, setup),
            daemon=True,
        )
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Return the exit code (negative: the signal) or None while it runs."""
        if self.returncode is None and self._proc.exitcode is not None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Return the exit code once it ends; raise ``subprocess.TimeoutExpired`` after ``timeout``."""
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process unless it has ended."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """Send SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Return (stdout, stderr) once it ends."""
        self.wait(timeout)
        outputs = tuple(Path(p).read_text() for p in (self._out, self._err))
        for path in (self._out, self._err):
            os.unlink(path)
        os.rmdir(self._dir)
        return outputs


def start(
    argv: list,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    setup: tuple[Callable, ...] | None = None,
) -> WarmProcess:
    """Start ``python -m shardckpt ARGV`` forked warm; ``setup`` = (function, *args) runs first in it."""
    return WarmProcess(argv, env, cwd, setup)


def start_torchrun(
    argv: list, env: dict[str, str] | None = None, cwd: Path | str | None = None
) -> WarmProcess:
    """Start ``torchrun ARGV`` with its agent forked warm; its ranks start fresh."""
    return WarmProcess(argv, env, cwd, program="torchrun")


def run(
    argv: list,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 120,
    setup: tuple[Callable, ...] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python -m shardckpt ARGV`` forked warm; return it finished (killed at ``timeout``)."""
    return _finished(start(argv, env, cwd, setup), timeout)


def run_torchrun(
    argv: list,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 150,
) -> subprocess.CompletedProcess:
    """Run ``torchrun ARGV`` with its agent forked warm; return it finished (killed at ``timeout``)."""
    return _finished(start_torchrun(argv, env, cwd), timeout)


def _finished(proc: WarmProcess, timeout: float) -> subprocess.CompletedProcess:
    """Return ``proc`` once it ends, killed after ``timeout`` seconds."""
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
