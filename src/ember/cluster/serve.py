"""`ember serve --ray`: join (or start) a Ray cluster, start the replicas, and serve the front until Ctrl-C."""

from __future__ import annotations

import sys

import uvicorn

from ember.cluster.front import create_front
from ember.cluster.ray_session import StartUp, connect
from ember.cluster.replica import ReplicaPool, ReplicaSettings
from ember.cluster.router import Router
from ember.serving.server import http_url, listen, serve_on


class ClusterServer:
    """The front on host:port over `replicas` replicas on the Ray cluster at `address` (None: a local one)."""

    def __init__(self, settings: ReplicaSettings, replicas: int, address: str | None,
                 host: str = "127.0.0.1", port: int = 8000, prefix_routing: bool = True) -> None:
        self._socket = listen(host, port)  # before Ray: a port in use is one line with nothing started
        self.host, self.port = self._socket.getsockname()[:2]
        self.router = Router(replicas, prefix_routing=prefix_routing)
        try:
            with StartUp() as start_up:
                self.session = connect(address, settings.threads, replicas, start_up)
                self.pool = ReplicaPool(self.router, settings)
                try:
                    self.pool.start()
                except BaseException:
                    self.session.close()
                    raise
        except BaseException:
            self._socket.close()
            raise
        config = uvicorn.Config(create_front(self.router), log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)

    @property
    def url(self) -> str:
        """The base URL of the OpenAI API (ends in /v1)."""
        return http_url(self.host, self.port) + "v1"

    def run(self) -> None:
        """Serve until interrupted, then stop the replicas and leave the cluster."""
        try:
            serve_on(self._server, self._socket)
        finally:
            self.pool.stop()
            self.session.close()


def serve(settings: ReplicaSettings, replicas: int, address: str | None, host: str, port: int,
          prefix_routing: bool = True) -> None:
    """Serve `settings.artifact_dir` from `replicas` replicas until Ctrl-C."""
    server = ClusterServer(settings, replicas, address, host, port, prefix_routing)
    print(f"ember: serving {settings.serve.model_name} at {server.url} from {replicas} replicas on Ray "
          f"({address or 'a local cluster'}; Ctrl-C stops)", file=sys.stderr, flush=True)
    server.run()
