"""A lean load generator's HTTP client: streamed completions over keep-alive loopback connections.

`bench_serve.py` runs its clients on the same cores as the server it measures. The official
`openai` client builds pydantic objects for every streamed chunk: on the 2-core benchmark host
it spent 0.8 CPU-seconds on the 1,883 tokens of a concurrency-1 level of the ~110M model, time
the server's compute threads lost. Load generators read the stream themselves for that
reason (vLLM's `benchmark_serving.py` with aiohttp, llama.cpp's server benchmark with k6).
This one is asyncio streams and `json` only: HTTP/1.1 requests with a Content-Length, answers
framed by Content-Length, chunked transfer encoding or the connection's end, and server-sent
events split at blank lines (`\\n\\n` or `\\r\\n\\r\\n`), comments (`: ping`) skipped.

    pool = ConnectionPool("127.0.0.1", 8000)
    async for event in pool.events("/v1/completions", {"prompt": "Hi", "stream": True}):
        ...                                  # each `data:` line's JSON, up to `[DONE]`
    await pool.close()

Leaving the loop early closes that connection (the server sees the client go); a finished
answer's connection goes back to the pool for the next request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any


class HTTPStatusError(RuntimeError):
    """A non-200 answer: its status and body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:500].decode(errors='replace')}")
        self.status, self.body = status, body


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class ConnectionPool:
    """Keep-alive connections to one server; each request takes an idle one or opens one."""

    def __init__(self, host: str, port: int, timeout: float = 600) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._idle: list[_Connection] = []

    async def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST `body` as JSON to `path` and yield the JSON of each server-sent event until `[DONE]`."""
        payload = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                   f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
        connection = self._idle.pop() if self._idle else await self._open()
        finished = False
        try:
            try:
                status, headers = await self._ask(connection, request)
            except (asyncio.IncompleteReadError, ConnectionError) as error:
                if isinstance(error, asyncio.IncompleteReadError) and error.partial:
                    raise
                # The server closed the kept-alive connection before reading the request (llama-server does after
                # each stream, though it answers `Keep-Alive`): once more on a new one, as HTTP clients do.
                connection.close()
                connection = await self._open()
                status, headers = await self._ask(connection, request)
            pieces = _body_pieces(connection.reader, headers)
            if status != 200:
                raise HTTPStatusError(status, b"".join([piece async for piece in pieces]))
            pending = b""
            async for piece in pieces:
                pending += piece.replace(b"\r\n", b"\n")
                *complete, pending = pending.split(b"\n\n")
                for event in complete:
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue  # a comment (": ping"), an event name, an id
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        yield json.loads(data)
            finished = headers.get("connection", "").lower() != "close"
        finally:
            if finished:
                self._idle.append(connection)
            else:  # left early, failed, or the server closes it: the server sees the client go
                connection.close()

    async def _open(self) -> _Connection:
        return _Connection(*await asyncio.open_connection(self.host, self.port))

    async def _ask(self, connection: _Connection, request: bytes) -> tuple[int, dict[str, str]]:
        """Send `request` on `connection`; the answer's status and headers."""
        connection.writer.write(request)
        await connection.writer.drain()
        return await asyncio.wait_for(_read_head(connection.reader), self.timeout)

    async def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the headers (names lower-cased) of an HTTP/1.1 answer."""
    status_line = await reader.readuntil(b"\r\n")
    parts = status_line.split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise RuntimeError(f"not an HTTP/1.1 answer: {status_line[:100]!r}")
    headers = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The answer's body as it arrives, unframed."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece
