"""Real etcd and Redis servers for the cluster tests, on loopback ports chosen at run time,
each in its own temporary directory, waited on by their ready lines (no sleeps) and stopped
by pid. A test that needs a binary that is not installed skips, naming it."""
from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from typing import List, Optional

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (scripts/install-deps.sh installs it)")
    return path


class Server:
    """A process whose output line containing ``ready`` marks it serving."""

    def __init__(self, argv: List[str], ready: str, timeout: float = 30.0) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvcd-cluster-")
        self.lines: List[str] = []
        self.proc = subprocess.Popen(argv, cwd=self.dir, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        seen = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if len(self.lines) < 10000:
                    self.lines.append(line)
                if ready in line:
                    seen.set()
            seen.set()

        threading.Thread(target=read, daemon=True).start()
        if not seen.wait(timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"{argv[0]} did not become ready:\n" + "".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Etcd(Server):
    def __init__(self) -> None:
        binary = need("etcd")
        self.port, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        url, purl = f"http://{self.endpoint}", f"http://127.0.0.1:{peer}"
        super().__init__([binary, "--name", "t", "--data-dir", "data",
                          "--listen-client-urls", url, "--advertise-client-urls", url,
                          "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
                          "--initial-cluster", f"t={purl}", "--log-level", "info"],
                         "ready to serve client requests")

    def call(self, path: str, body: dict) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            assert r.status == 200, (path, r.status, data)
            return json.loads(data)
        finally:
            conn.close()

    def grant(self, ttl: int) -> str:
        return self.call("/v3/lease/grant", {"TTL": ttl})["ID"]

    def put(self, key: str, value: bytes, lease: Optional[str] = None) -> None:
        body = {"key": base64.b64encode(key.encode()).decode(),
                "value": base64.b64encode(value).decode()}
        if lease:
            body["lease"] = lease
        self.call("/v3/kv/put", body)

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": base64.b64encode(key.encode()).decode()})

    def revoke(self, lease: str) -> None:
        self.call("/v3/lease/revoke", {"ID": lease})


class Redis(Server):
    def __init__(self) -> None:
        binary = need("redis-server")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        super().__init__([binary, "--port", str(self.port), "--bind", "127.0.0.1",
                          "--save", "", "--appendonly", "no"], "Ready to accept connections")

    def client(self):
        import redis
        return redis.Redis.from_url(self.url)
