"""``mmpipe serve``: the engine behind uvicorn, until Ctrl-C or SIGTERM, then a drain.

uvicorn runs in a thread of its own (:func:`start_http`), so that this process's main thread owns
the signals: uvicorn re-raises a signal it caught once it has stopped, which would end the process
before the engine drains. Here the first Ctrl-C / SIGTERM stops accepting connections and waits
for in-flight HTTP requests; then the engine finishes its queued jobs and stops its workers; a
second Ctrl-C stops waiting for HTTP requests.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import threading
import time
from types import FrameType

import uvicorn

from mmpipe.config import ServeConfig
from mmpipe.serve.app import API_KEY_ENV, ServingEngine, create_app, resolve_api_key
from mmpipe.serve.engine import Engine

_START_TIMEOUT_S = 60.0


class HttpServer:
    """uvicorn serving an engine from a background thread, on a socket bound before it starts. The
    API key (``engine.cfg.api_key``, else ``$MMPIPE_API_KEY``) is read here, once."""

    def __init__(self, engine: ServingEngine, sock: socket.socket, *, log_level: str = "info") -> None:
        self.socket = sock
        self.host, self.port = sock.getsockname()[:2]
        self.authenticated = (api_key := resolve_api_key(engine.cfg.api_key)) is not None
        app = create_app(engine, api_key=api_key)
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` (the real port when 0 was asked for)."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> HttpServer:
        """Start serving; returns once uvicorn accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, *, force: bool = False) -> None:
        """Stop accepting connections; in-flight requests finish first unless ``force``."""
        self.server.should_exit = True
        self.server.force_exit = self.server.force_exit or force

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the server thread to end; False on timeout."""
        self.thread.join(timeout)
        return not self.thread.is_alive()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port); ValueError when it cannot be had."""
    try:
        sock = socket.create_server((host, port))
    except OSError as err:
        raise ValueError(f"serve: cannot listen on host={host} port={port}: {err.strerror or err}") from None
    # Accepted connections inherit TCP_NODELAY (Linux): without it a keep-alive client's next request
    # waits out Nagle + delayed ACK (~40 ms) on every response written as headers and body.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def serve(cfg: ServeConfig) -> None:
    """Serve ``cfg``'s graph until Ctrl-C / SIGTERM; drain in-flight requests, then return."""

    resolve_api_key(
        cfg.api_key, env={}
    )  # refuses an empty key before any worker starts (HttpServer reads $MMPIPE_API_KEY)
    sock = bind(cfg.host, cfg.port)  # before any worker starts: a taken port is a config error
    try:
        engine = Engine(cfg)
    except BaseException:
        sock.close()
        raise
    try:
        http = HttpServer(engine, sock)
        warn_if_exposed(cfg.host, http.authenticated)
        http.start()
        print(f"mmpipe serve: {http.url}", flush=True)
        print(engine.placement_text(), flush=True)
        _wait_for_signal(http)
    finally:
        engine.close(drain=True)
    print("mmpipe serve: stopped", flush=True)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is reachable from this machine only."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback  # 127.0.0.0/8, ::1
    except ValueError:  # a host name: it may resolve to any address
        return False


def exposure_warning(host: str, authenticated: bool) -> str | None:
    """The start-up warning for a server that other machines can reach without a key, or None."""
    if authenticated or is_loopback(host):
        return None
    return (
        f"mmpipe serve: warning: host={host} accepts connections from other machines and no API key is set: "
        f"anyone who reaches it can use it (set api_key=KEY or ${API_KEY_ENV})"
    )


def warn_if_exposed(host: str, authenticated: bool) -> None:
    """Print :func:`exposure_warning`'s line on stderr, if there is one."""
    warning = exposure_warning(host, authenticated)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def _wait_for_signal(http: HttpServer) -> None:
    """Block until the server thread ends; the first SIGINT / SIGTERM stops it, a second forces it."""
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if not stopping:
            print("mmpipe serve: stopping: finishing in-flight requests (Ctrl-C again to stop waiting)", flush=True)
        http.stop(force=stopping)
        stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not http.join(timeout=0.5):  # short joins: signal handlers run between them
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
