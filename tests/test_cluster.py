"""`ember serve --ray`: replicas on a two-node Ray cluster on loopback behind one OpenAI endpoint.

The cluster is started by `ray start` here (a head and a second node, one CPU each, in a temporary directory of
their own) and stopped by killing the processes whose command line names that directory. The front listens on
127.0.0.1; Ray 2.60 registers each node at the machine's own address whatever `--node-ip-address` says, so the
replicas' servers listen there. The tiny long-context llama serves; the official `openai` client talks to the front.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import RAY_ENV, RAY_START_TIMEOUT, REPO_ROOT, free_port, local_ray_cluster, run_ember

from ember.cluster.router import Router, routing_key

pytestmark = pytest.mark.cluster
openai = pytest.importorskip("openai")
pytest.importorskip("ray")
pytest.importorskip("psutil")

START_TIMEOUT = RAY_START_TIMEOUT  # seconds for the served replicas to come up on a loaded 2-core machine
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def ray_cluster():
    """The head's address (127.0.0.1:PORT) of a Ray cluster of two one-CPU nodes on loopback."""
    with local_ray_cluster(nodes=2, cpus=1) as address:
        yield address


@pytest.fixture(scope="module")
def cluster_url(ray_cluster, tiny_llama_long, tmp_path_factory):
    """`ember serve --ray CLUSTER --replicas 2` on a free loopback port: its base URL, once both replicas serve."""
    log = tmp_path_factory.mktemp("cluster") / "serve.log"
    port = free_port()
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(tiny_llama_long.artifact_dir),
                                    "--ray", ray_cluster, "--replicas", "2", "--port", str(port)],
                                   cwd=REPO_ROOT, stderr=stderr, stdout=subprocess.DEVNULL, env=RAY_ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not re.search(r"serving \S+ at http://", log.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as answer:
        return json.load(answer)


def _metric(url: str, name: str, replica: int) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    match = re.search(rf'^{name}{{replica="{replica}"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stream(client, prompt: str, max_tokens: int = MAX_TOKENS, pause: threading.Barrier | None = None):
    """A greedy streamed completion: (replica that answered, text, the error that ended it or None)."""
    with client.completions.with_streaming_response.create(model="llama-long", prompt=prompt, stream=True,
                                                           max_tokens=max_tokens, temperature=0) as response:
        replica, pieces = int(response.headers["x-ember-replica"]), []
        try:
            for count, chunk in enumerate(response.parse()):
                pieces.append(chunk.choices[0].text if chunk.choices else "")
                if pause is not None and count == 2:
                    pause.wait(timeout=120)
        except openai.APIError as err:
            return replica, "".join(pieces), err
    return replica, "".join(pieces), None


def _whole(client, prompt: str, max_tokens: int) -> str:
    """A greedy completion answered whole."""
    return client.completions.create(model="llama-long", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0).choices[0].text


def test_routing_key_is_the_prompt_start():
    """Chats sharing system messages share a key whatever their user turn; completions share it by their start."""
    system = {"role": "system", "content": "You answer as a pirate."}
    chat = [json.dumps({"model": "m", "messages": [system, {"role": "user", "content": question}]}).encode()
            for question in ("hi", "bye")]
    assert routing_key("/v1/chat/completions", chat[0]) == routing_key("/v1/chat/completions", chat[1])
    plain = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert routing_key("/v1/chat/completions", plain) != routing_key("/v1/chat/completions", chat[0])
    long = "x" * 300
    assert routing_key("/v1/completions", json.dumps({"prompt": long + "a"}).encode()) == \
        routing_key("/v1/completions", json.dumps({"prompt": long + "b"}).encode())
    assert routing_key("/v1/completions", b"{not json") is None


def test_router_keeps_a_prefix_on_its_replica_unless_it_is_far_busier():
    """A known prefix goes to its replica; a new one to the least loaded; a dead replica's prefixes move."""
    router = Router(2, slack=0)
    router.set_alive(0, {"url": "a"})
    router.set_alive(1, {"url": "b"})
    first = router.pick("k")
    assert router.pick("other").index != first.index  # least loaded
    assert router.pick("k").index == first.index and first.prefix_routed == 1
    assert router.pick("k").index != first.index  # 2 in flight there against 1: past the slack
    router.set_dead(first.index)
    assert router.pick("k").index != first.index
    router.set_dead(1 - first.index)
    assert router.pick("k") is None


def test_router_without_prefix_routing_sends_a_known_prefix_to_the_least_loaded_replica():
    """With prefix_routing=False a prefix seen before is spread like any request: the replicas take turns."""
    router = Router(2, prefix_routing=False)
    router.set_alive(0, {"url": "a"})
    router.set_alive(1, {"url": "b"})
    picked = []
    for _ in range(4):
        replica = router.pick("k")
        picked.append(replica.index)
        router.done(replica)
    assert picked == [0, 1, 0, 1]
    assert sum(replica["prefix_routed"] for replica in router.snapshot()) == 0


def test_an_unreachable_cluster_address_is_one_line(tiny_llama):
    """An address where nothing answers, one where a server other than Ray's does, and --replicas 0 fail with one
    line within seconds, nothing started."""
    closed = run_ember("serve", str(tiny_llama.artifact_dir), "--ray", f"127.0.0.1:{free_port()}", timeout=60)
    assert closed.returncode == 1
    assert closed.stderr.strip().count("\n") == 0 and "no Ray cluster answers there" in closed.stderr
    with socket.create_server(("127.0.0.1", 0)) as listener:  # answers, but HTTP/1 as a web server would
        def refuse() -> None:
            connection, _ = listener.accept()
            with connection:
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=refuse, daemon=True).start()
        other = run_ember("serve", str(tiny_llama.artifact_dir), "--ray", f"127.0.0.1:{listener.getsockname()[1]}",
                          timeout=60)
    assert other.returncode == 1 and other.stderr.strip().count("\n") == 0
    assert "not a Ray cluster's head" in other.stderr
    zero = run_ember("serve", str(tiny_llama.artifact_dir), "--ray", "--replicas", "0", timeout=60)
    assert zero.returncode == 1 and zero.stderr.strip().count("\n") == 0 and "--replicas 0" in zero.stderr


def test_a_server_that_speaks_http2_and_goes_silent_is_refused_within_the_handshake_deadline(tiny_llama):
    """A server that answers the HTTP/2 preface (as any gRPC server does) and then says nothing: Ray's own handshake
    gets no answer within its deadline, and the command ends with one line instead of Ray retrying for minutes."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        done = threading.Event()

        def silent() -> None:
            connection, _ = listener.accept()
            with connection:
                connection.recv(64)
                connection.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # an empty SETTINGS frame, then nothing
                done.wait(90)

        threading.Thread(target=silent, daemon=True).start()
        try:
            result = run_ember("serve", str(tiny_llama.artifact_dir), "--ray", f"127.0.0.1:{listener.getsockname()[1]}",
                               timeout=60)
        finally:
            done.set()
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "not a Ray cluster's head (it did not answer Ray's handshake within 10 s)" in result.stderr


def test_a_temporary_directory_too_long_for_rays_sockets_is_one_line(tiny_llama, tmp_path):
    """TMPDIR so long that a local cluster's socket paths pass 107 bytes: refused naming the variable before Ray
    starts (no session directory is made under it)."""
    long_dir = tmp_path / ("t" * 100)
    long_dir.mkdir()
    if "RAY_TMPDIR" in os.environ:
        pytest.skip("RAY_TMPDIR overrides TMPDIR for Ray")
    result = run_ember("serve", str(tiny_llama.artifact_dir), "--ray", timeout=60, env={"TMPDIR": str(long_dir)})
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "TMPDIR: a local Ray cluster keeps its sockets under" in result.stderr and "107 bytes" in result.stderr
    assert list(long_dir.iterdir()) == []


def test_more_replicas_than_the_cluster_hosts_is_one_line(ray_cluster, tiny_llama):
    """Three one-CPU replicas on a two-CPU cluster are refused before any starts."""
    result = run_ember("serve", str(tiny_llama.artifact_dir), "--ray", ray_cluster, "--replicas", "3", timeout=120,
                        env=RAY_ENV)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ember: error: --replicas 3: the Ray cluster has 2 CPUs"), result.stderr
    assert "Traceback" not in result.stderr


def test_concurrent_streams_equal_their_solo_runs(cluster_url):
    """16 concurrent greedy streams through two replicas equal the same prompts run one at a time."""
    client = _client(cluster_url)
    prompts = [f"Once upon a time number {i}" for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda prompt: _stream(client, prompt), prompts))
    solo = [_stream(client, prompt) for prompt in prompts]
    assert [error for _, _, error in together] == [None] * 16
    assert [text for _, text, _ in together] == [text for _, text, _ in solo]
    assert {replica for replica, _, _ in together} == {0, 1}  # distinct prompts spread to the least loaded


def test_a_shared_system_prompt_lands_on_one_replica(cluster_url):
    """Chats that share a system prompt go to one replica, whose prefix cache then serves their start."""
    client = _client(cluster_url)
    system = {"role": "system", "content": "You are a terse assistant who answers in riddles. " * 6}
    replicas = []
    for question in ("What is the sea?", "Who are you?", "Where is home?", "Why?", "When?", "How?"):
        answer = client.chat.completions.with_raw_response.create(
            model="llama-long", messages=[system, {"role": "user", "content": question}], max_tokens=4)
        replicas.append(int(answer.headers["x-ember-replica"]))
    assert len(set(replicas)) == 1, replicas
    assert _metric(cluster_url, "ember_cluster_prefix_routed_total", replicas[0]) >= 5
    assert _metric(cluster_url, "ember_prefix_cache_hits_total", replicas[0]) >= 5


def _generated(url: str) -> float:
    return sum(_metric(url, "ember_generation_tokens_total", replica) for replica in (0, 1))


def test_a_client_gone_before_its_whole_answer_stops_its_generation(cluster_url):
    """A client that closes its connection before a whole answer arrives cancels that generation on its replica."""
    before = _generated(cluster_url)
    body = json.dumps({"model": "llama-long", "prompt": "hi", "max_tokens": 900, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", int(cluster_url.rsplit(":", 1)[1]))) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.02)
    time.sleep(3)
    assert _generated(cluster_url) - before < 900


def test_a_killed_replica_ends_its_streams_cleanly_and_is_replaced(cluster_url):
    """SIGKILL to one replica mid-run: the other's streams finish whole, the dead one's end with an error event
    (what they streamed a prefix of their solo run), whole answers not yet given are answered by the survivor,
    the next requests are served, and a replacement starts."""
    client = _client(cluster_url)
    prompts = [f"A long tale, chapter {i}:" for i in range(8)]
    wholes = [f"A long poem, canto {i}:" for i in range(2)]
    solo = {prompt: _stream(client, prompt, 600)[1] for prompt in prompts + wholes}
    before = {replica["replica"]: replica["pid"] for replica in _health(cluster_url)["replicas"]}
    started = threading.Barrier(len(prompts) + 1)
    with ThreadPoolExecutor(len(prompts) + len(wholes)) as pool:
        runs = [pool.submit(_stream, client, prompt, 600, started) for prompt in prompts]
        whole_runs = [pool.submit(_whole, client, prompt, 600) for prompt in wholes]
        started.wait(timeout=120)
        victim = max(before, key=lambda index: _health(cluster_url)["replicas"][index]["in_flight"])
        os.kill(before[victim], signal.SIGKILL)
        results = dict(zip(prompts, (run.result(timeout=120) for run in runs)))
        assert [run.result(timeout=120) for run in whole_runs] == [solo[prompt] for prompt in wholes]
    lost = 0
    for prompt, (replica, text, error) in results.items():
        if error is None:
            assert text == solo[prompt]
        else:  # never silently cut short, nor continued by another replica
            assert replica == victim and "stopped mid-answer" in str(error) and solo[prompt].startswith(text)
            lost += 1
    assert lost >= 1
    assert all(error is None for replica, _, error in results.values() if replica != victim)
    assert _stream(client, prompts[0], 600)[1] == solo[prompts[0]]  # served at once by the survivor
    deadline = time.monotonic() + START_TIMEOUT
    while not (state := _health(cluster_url)["replicas"][victim])["alive"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
    assert state["restarts"] == 1 and state["pid"] != before[victim]
