"""Start a real server in a subprocess on 127.0.0.1 and wait until it answers."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(
    command: Sequence[str], probe: str, log_path: Path, env: dict[str, str], timeout: float = 180
) -> Iterator[subprocess.Popen]:
    """Run ``command`` until the ``with`` block ends; ``probe`` is a URL that answers 200 once
    the server is up."""
    log = log_path.open("w+")
    process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"server did not start:\n{log.read()[-4000:]}")
            try:
                if httpx.get(probe, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@contextlib.contextmanager
def shop_server(seed: int, families: int, split: str, log_path: Path) -> Iterator[str]:
    """Our shop over WebShop's HTTP protocol (``shop_server``): the instructions of ``split``
    of the shop of ``seed``, ``families`` per category, as sessions ``fixed_<i>``; yields its
    URL."""
    port = free_port()
    command = [sys.executable, "-m", "memsearcher.agent.environments.shop_server"]
    command += ["--seed", str(seed), "--families-per-category", str(families)]
    command += ["--split", split, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with running(command, f"{url}/fixed_0", log_path, dict(os.environ), 120):
        yield url


def connect(url: str) -> socket.socket:
    """A raw TCP connection to the server at ``url`` (``http://host:port``)."""
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, or ``limit`` seconds pass (then:
    what came), and after how many seconds."""
    started, data = time.monotonic(), b""
    for _ in range(1000):
        left = started + limit - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - started
