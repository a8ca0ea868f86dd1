"""The warm-job server (tools/warm.py): a job run through it is the job run in its own process (output, files,
exit status), signals reach the job, a killed client's job is stopped, and no server means the job runs anyway."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import warm

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["train", "--setup", "digits-mlp", "--optimizer", "adam", "--scale", "smoke", "--no-progress"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of this test module (preloading the companion's training stack), stopped at the end."""
    path = str(tmp_path_factory.mktemp("warm") / "s.sock")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    process = subprocess.Popen([sys.executable, "-m", "tools.warm", "serve", "--socket", path, "--parent",
                                str(os.getpid()), "--idle", "300"], cwd=ROOT, env=env, start_new_session=True)
    for _ in range(1200):
        if os.path.exists(path):
            break
        assert process.poll() is None, "the server ended before it listened"
        time.sleep(0.05)
    yield path
    warm.stop(path)
    process.wait(timeout=30)
    assert not os.path.exists(path), "the server left its socket behind"


def _client(args: list[str], socket_path: str | None, log: Path, **kw) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop(warm.SOCKET_VARIABLE, None)
    if socket_path is not None:
        env[warm.SOCKET_VARIABLE] = socket_path
    out = open(log, "wb")
    return subprocess.Popen([sys.executable, "-m", "tools.warm", "run", "--", *args], cwd=ROOT, env=env,
                            stdout=out, stderr=subprocess.STDOUT, **kw)


def _summary(out: Path, seed: int) -> dict:
    summary = json.loads((out / "smoke" / "digits-mlp" / "adam" / f"seed-{seed}" / "summary.json").read_text())
    summary.pop("wall_time_s")
    return summary


def test_a_job_through_the_server_is_the_job_in_its_own_process(server, tmp_path):
    """The same summary (bit for bit but its wall time), the same log line, the status 0; and the server answers a
    second job (the fork leaves it able to fork again)."""
    for seed in (0, 1):
        warm_client = _client([*TRAIN, "--seed", str(seed), "--out", str(tmp_path / "warm")], server,
                              tmp_path / f"warm{seed}.log")
        assert warm_client.wait(timeout=300) == 0, (tmp_path / f"warm{seed}.log").read_text()
    alone = subprocess.run([sys.executable, "-m", "companion", *TRAIN, "--seed", "1", "--out",
                            str(tmp_path / "alone")], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr
    assert _summary(tmp_path / "warm", 1) == _summary(tmp_path / "alone", 1)
    assert "final_train_loss=" in (tmp_path / "warm1.log").read_text()


def test_a_refused_command_line_keeps_its_status_and_its_words(server, tmp_path):
    """argparse's refusal (status 2, the message on stderr) comes back through the server unchanged."""
    client = _client(["train", "--setup", "no-such-setup", "--optimizer", "adam", "--scale", "smoke"], server,
                     tmp_path / "bad.log")
    assert client.wait(timeout=120) == 2
    assert "no-such-setup" in (tmp_path / "bad.log").read_text()


def _long_run(out: Path) -> list[str]:
    return [*TRAIN, "--seed", "3", "--out", str(out), "--set", "epochs=100000", "--checkpoint-every", "1"]


def _wait_for_training(out: Path, log: Path) -> None:
    run = out / "smoke" / "digits-mlp" / "adam" / "seed-3"
    for _ in range(600):
        if (run / "config.json").exists() and "step" in log.read_text():
            return
        time.sleep(0.1)
    pytest.fail(f"the run did not start: {log.read_text()}")


def test_sigterm_to_the_client_reaches_the_job(server, tmp_path):
    """The runner's own SIGTERM path runs in the forked job: resume.pt saved, the status 128 + 15 returned."""
    client = _client(_long_run(tmp_path / "runs"), server, tmp_path / "term.log")
    _wait_for_training(tmp_path / "runs", tmp_path / "term.log")
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=120) == 128 + signal.SIGTERM, (tmp_path / "term.log").read_text()
    assert (tmp_path / "runs" / "smoke" / "digits-mlp" / "adam" / "seed-3" / "resume.pt").exists()


def test_a_killed_clients_job_is_stopped(server, tmp_path):
    """A client killed outright (Snakemake's kill -9) leaves no job training on: the server sends it SIGTERM, the
    runner saves resume.pt and ends, and its lock is free for the next job."""
    client = _client(_long_run(tmp_path / "runs"), server, tmp_path / "kill.log")
    _wait_for_training(tmp_path / "runs", tmp_path / "kill.log")
    client.kill()
    client.wait(timeout=30)
    resume = tmp_path / "runs" / "smoke" / "digits-mlp" / "adam" / "seed-3" / "resume.pt"
    for _ in range(600):
        if resume.exists() and "interrupted" in (tmp_path / "kill.log").read_text():
            break
        time.sleep(0.1)
    assert "interrupted" in (tmp_path / "kill.log").read_text()
    assert resume.exists()


def test_without_a_server_the_job_runs_in_the_clients_own_process(tmp_path):
    """No server listening at the named socket (or none named): the client runs the command itself."""
    for socket_path in (str(tmp_path / "nobody.sock"), None):
        client = _client([*TRAIN, "--seed", "0", "--out", str(tmp_path / "runs")], socket_path,
                         tmp_path / "alone.log")
        assert client.wait(timeout=300) == 0, (tmp_path / "alone.log").read_text()
    assert _summary(tmp_path / "runs", 0)["optimizer"] == "adam"


def test_a_waited_servers_jobs_count_as_the_starting_processs_childrens_cpu_time(tmp_path):
    """The build's record counts the CPU time of Snakemake's children as the build's own: a server started with
    :func:`warm.start` and waited for after :func:`warm.stop` brings its jobs' CPU time (forks it reaped) along; a
    server never waited for left the warm jobs' time outside (a build read as 1.66 other cores busy)."""
    path = str(tmp_path / "s.sock")
    before = os.times()
    old = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH")}
    os.environ.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    try:
        server = warm.start(path, os.getpid(), str(tmp_path / "s.log"))
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    for _ in range(1200):
        if os.path.exists(path):
            break
        time.sleep(0.05)
    client = _client([*TRAIN, "--seed", "0", "--out", str(tmp_path / "runs")], path, tmp_path / "job.log")
    assert client.wait(timeout=300) == 0
    client_cpu = os.times()
    assert warm.stop(path)
    server.wait(timeout=60)
    after = os.times()
    forked = (after.children_user + after.children_system) - (client_cpu.children_user + client_cpu.children_system)
    assert forked > 1.0, f"the server's and its job's CPU time: {forked:.2f} s"  # imports alone are seconds
    assert before.children_user <= after.children_user
