"""Warm jobs: the workflow's ``python -m companion ...`` jobs forked from one server that imported the heavy modules
once per build, instead of each job importing them again.

Why: on this project's cpu scale a job's own work is often smaller than its imports. A digits run trains for about a
second inside a ~9 s process, of which ~7 s is importing torch's compiler stack (``torch.optim`` imports
``torch._dynamo``), scikit-learn and SciPy (the digits loader) and the companion; a tweets run pays the same plus the
Hugging Face stack. The server (:func:`serve`) imports them once; each job is a small client (:func:`run`) that
hands the server its command line, working folder, environment and its own stdin/stdout/stderr (so the job's log is
written exactly as before), and the server forks a child that runs :func:`companion.__main__.main` on them.

The contract a job keeps, with or without the server:

- the same command line, output files, log and exit status (the child's, passed back to the client);
- signals: SIGTERM, SIGINT and SIGHUP sent to the client are sent on to the child (the runner saves ``resume.pt`` and
  exits as it would), and a client that dies (Snakemake killed it) has its child sent SIGTERM;
- no server (``IEF_WARM_SOCKET`` unset, or nothing listening there): the client runs the command itself, in-process.

Fork safety: the server starts no thread and runs no torch operator before it forks (importing torch starts no
OpenMP pool), so each child starts as a fresh process would, with its environment's thread settings applied. The
server lives in its own session (no terminal's Ctrl-C reaches a child twice) and exits when the process that started
it (Snakemake) is gone, when told to stop, or after ``idle_s`` seconds without a job.

    python -m tools.warm serve --socket PATH --parent PID     # started by the workflow (workflow/rules/common.smk)
    python -m tools.warm run -- train --setup digits-mlp ...   # one job: what `python -m companion train ...` does
    python -m tools.warm stop --socket PATH
"""
from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys
import time

SOCKET_VARIABLE = "IEF_WARM_SOCKET"  # where the server listens; set for every job by the workflow
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "numpy", "scipy.stats", "sklearn.datasets", "transformers",
           "peft", "ief", "ief.hf", "companion.__main__", "companion.experiments.runner",
           "companion.experiments.models", "companion.experiments.data", "companion.experiments.evaluate_runs")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_MAX_REQUEST = 1 << 20  # bytes of one job's request (command line and environment)


# ------------------------------------------------------------------------------------------------------- client
def run(argv: list[str], socket_path: str | None = None) -> int:
    """One job: ``python -m companion ARGV`` run by the server's fork, or here when no server answers.

    Args:
        argv: the companion command line (e.g. ``["train", "--setup", "digits-mlp", ...]``).
        socket_path: the server's socket (default: ``$IEF_WARM_SOCKET``; none: run here).

    Returns:
        The command's exit status.
    """
    socket_path = socket_path if socket_path is not None else os.environ.get(SOCKET_VARIABLE)
    conn = _connect(socket_path) if socket_path else None
    if conn is None:
        return _run_here(argv)
    with conn:
        request = json.dumps({"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(conn, [request], [0, 1, 2])
        child: list[int] = []

        def forward(signum, _frame):
            if child:
                os.kill(child[0], signum)

        for signum in FORWARDED:
            signal.signal(signum, forward)
        reader = conn.makefile("r")
        for line in reader:
            word, _, value = line.strip().partition(" ")
            if word == "pid":
                child.append(int(value))
            elif word == "exit":
                return int(value)
        return _lost(child)


def _lost(child: list[int]) -> int:
    """The server closed the connection without an exit status (it was stopped): the job failed."""
    print(f"error: the warm-job server stopped before the job{' (pid %d)' % child[0] if child else ''} finished",
          file=sys.stderr)
    return 1


def _connect(path: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    return conn


def _run_here(argv: list[str]) -> int:
    from companion.__main__ import main

    try:
        return int(main(list(argv)) or 0)
    except SystemExit as stop:  # argparse's own exits (--help, a bad flag)
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)


# ------------------------------------------------------------------------------------------------------- server
def serve(socket_path: str, parent: int | None = None, idle_s: float = 600.0,
          preload: tuple[str, ...] = PRELOAD) -> None:
    """Import ``preload`` once, then run each client's command in a forked child until stopped.

    Args:
        socket_path: the Unix socket to listen on (replaced if a stale one is there).
        parent: a process id; the server exits when it is gone (None: no such watch).
        idle_s: the server exits after this many seconds with no job running and none asked for.
        preload: modules imported before any fork (a module that cannot be imported is skipped).

    Returns:
        None, when the server stops.
    """
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (an optional module: the jobs import what they need themselves)
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_read, wake_write = os.pipe()  # a child's end wakes the loop at once (a job's status is not held back)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    jobs: dict[int, socket.socket] = {}  # child pid -> its client's connection
    orphans: set[int] = set()  # children whose client is gone (told to stop once, reaped when they end)
    last = time.monotonic()
    try:
        while True:
            watched = [c for p, c in jobs.items() if p not in orphans]
            readable, _, _ = select.select([listener, wake_read, *watched], [], [], 1.0)
            for conn in readable:
                if conn == wake_read:
                    os.read(wake_read, 4096)
                elif conn is listener:
                    started = _start(listener)
                    if started == "stop":
                        return
                    if started is not None:
                        jobs[started[0]] = started[1]
                else:  # a client's connection closed (the job was killed): its child is told to stop, once
                    pid = next(p for p, c in jobs.items() if c is conn)
                    orphans.add(pid)
                    _terminate(pid)
            for pid in _reap(jobs):
                orphans.discard(pid)
            if jobs:
                last = time.monotonic()
            if (parent is not None and not _alive(parent)) or time.monotonic() - last > idle_s:
                return
    finally:
        for pid in list(jobs):
            _terminate(pid)
        listener.close()
        if os.path.exists(socket_path):
            os.unlink(socket_path)


def _start(listener: socket.socket):
    """Accept one client: ``"stop"``, None (a malformed request, answered with exit 2), or (child pid, connection)."""
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
    request = json.loads(message or b"{}")
    if request.get("stop"):
        conn.close()
        return "stop"
    if len(fds) != 3 or not isinstance(request.get("argv"), list):
        for fd in fds:
            os.close(fd)
        conn.sendall(b"exit 2\n")
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:  # the child: never returns
        signal.set_wakeup_fd(-1)
        listener.close()
        conn.close()
        _child(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    return pid, conn


def _child(request: dict, fds: list[int]) -> None:
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for signum in (*FORWARDED, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _apply_threads()
        sys.argv = [sys.executable, "-m", "companion", *request["argv"]]
        code = _run_here(request["argv"])
    except BaseException:  # noqa: BLE001  (whatever ends the job is printed to its log, as a process would)
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _apply_threads() -> None:
    """The job's environment's thread count, applied to the torch imported before the fork."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(value))


def _reap(jobs: dict[int, socket.socket]) -> list[int]:
    """Each child that ended: its status sent to its client (a signal's end as the shell says it, 128 + N)."""
    ended = []
    for pid in list(jobs):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            conn = jobs.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(f"exit {code if code >= 0 else 128 - code}\n".encode())
            except OSError:
                pass
            conn.close()
            ended.append(pid)
    return ended


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop(socket_path: str) -> bool:
    """Ask the server at ``socket_path`` to stop.

    Args:
        socket_path: its socket.

    Returns:
        Whether a server was there to ask.
    """
    conn = _connect(socket_path)
    if conn is None:
        return False
    with conn:
        socket.send_fds(conn, [json.dumps({"stop": True}).encode()], [])
    return True


def start(socket_path: str, parent: int, log_path: str):
    """Start a server in the background (its own session), for the workflow's ``onstart``.

    Args:
        socket_path: where it listens.
        parent: the process whose end ends the server (Snakemake's).
        log_path: the server's own output (a failed import, a crash).

    Returns:
        The server's ``subprocess.Popen``: wait for it after :func:`stop`, so that its jobs' CPU time (the forks it
        reaped) is counted as the starting process's children's, as a job started directly would be.
    """
    import subprocess

    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "tools.warm", "serve", "--socket", socket_path,
                                    "--parent", str(parent)], stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return process


def main(argv: list[str] | None = None) -> int:
    """``serve``, ``run -- ARGS`` or ``stop`` (module docstring); returns the exit status."""
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        rest = argv[1:]
        return run(rest[1:] if rest[:1] == ["--"] else rest)
    parser = argparse.ArgumentParser(prog="python -m tools.warm")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--socket", required=True)
    s.add_argument("--parent", type=int, default=None)
    s.add_argument("--idle", type=float, default=600.0)
    t = sub.add_parser("stop")
    t.add_argument("--socket", required=True)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.socket, args.parent, args.idle)
        return 0
    return 0 if stop(args.socket) else 1


if __name__ == "__main__":
    sys.exit(main())
