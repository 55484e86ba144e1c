"""`ember serve --ray` start-up: a signal at any stage of it ends the command within 2 s, leaving no process of the
local cluster behind; and a cluster with Ray's token authentication (on by default since Ray 2.52) is joined when
told to send the token, refused in one line otherwise.

The stages are recognised by the processes the command has started (`ray start`, then the head's GCS, then a
replica's actor), not by sleeping, so a slow machine moves the signal with them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO_ROOT, local_ray_cluster, run_ember

pytestmark = pytest.mark.cluster
pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

STAGE_TIMEOUT = 240  # seconds for a stage to be reached on a loaded 2-core machine
SIGNAL_BOUND = 2.0  # seconds from the signal to the command's exit (issue #66)

# stage -> what a descendant's command line shows once the command is in it
STAGES = {
    "the local cluster starting": lambda cmdline: "ray.scripts.scripts" in cmdline and "start" in cmdline,
    "the head serving": lambda cmdline: "gcs_server" in cmdline,
    "a replica loading": lambda cmdline: "ReplicaActor" in cmdline,
}


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("stage, signum", [("the local cluster starting", signal.SIGTERM),
                                           ("the head serving", signal.SIGINT),
                                           ("a replica loading", signal.SIGTERM)])
def test_a_signal_during_start_up_ends_it_within_2_s_and_stops_the_local_cluster(tiny_llama, stage, signum):
    process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(tiny_llama.artifact_dir), "--ray",
                                "--replicas", "1", "--port", "0"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + STAGE_TIMEOUT
        while not any(STAGES[stage](" ".join(p.cmdline())) for p in _descendants(process.pid) if p.is_running()):
            assert process.poll() is None and time.monotonic() < deadline, f"never reached {stage}"
            time.sleep(0.05)
        started = _descendants(process.pid)
        sent = time.monotonic()
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert took < SIGNAL_BOUND, f"{signal.Signals(signum).name} during {stage}: exit after {took:.2f} s"
    assert process.returncode == 128 + signum, stderr
    assert stderr.strip().splitlines() == ["ember: interrupted" if signum == signal.SIGINT else "ember: terminated"]
    psutil.wait_procs(started, timeout=1)
    left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline()[:2] for p in left]


def test_a_cluster_with_token_authentication_is_joined_when_told_to_send_the_token(tiny_llama, tmp_path):
    """A head started with Ray's default token authentication (its token in a home of its own): without
    RAY_AUTH_MODE=token the address is refused in one line saying so (Ray sends a token to an address only when
    told to); with it, the replica starts and the command serves."""
    home = tmp_path / "home"
    home.mkdir()
    auth_env = {key: value for key, value in os.environ.items() if key != "RAY_AUTH_MODE"}
    auth_env.update(HOME=str(home), RAY_AUTH_MODE="token")
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"], env=auth_env,
                   capture_output=True, timeout=120, check=True)
    assert (home / ".ray" / "auth_token").is_file()
    with local_ray_cluster(nodes=1, cpus=1, env=auth_env) as address:
        unasked = {**auth_env}
        del unasked["RAY_AUTH_MODE"]
        refused = run_ember("serve", str(tiny_llama.artifact_dir), "--ray", address, "--replicas", "1", timeout=60,
                            env=unasked)
        assert refused.returncode == 1 and refused.stderr.strip().count("\n") == 0, refused.stderr
        assert "the Ray cluster there requires token authentication; set RAY_AUTH_MODE=token" in refused.stderr
        log = tmp_path / "serve.log"
        with open(log, "w") as stderr:
            serving = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(tiny_llama.artifact_dir), "--ray",
                                        address, "--replicas", "1", "--port", "0"], cwd=REPO_ROOT, env=auth_env,
                                       stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        try:
            deadline = time.monotonic() + STAGE_TIMEOUT
            while not re.search(r"serving \S+ at http://", log.read_text()):
                assert serving.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
        finally:
            serving.send_signal(signal.SIGTERM)
            serving.wait(timeout=60)
    assert Path(log).read_text().count("Traceback") == 0
