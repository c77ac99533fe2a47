"""A real server for tests: uvicorn serving an app on 127.0.0.1 at a free port, on its own thread, with
plain-HTTP requests and the engine's running-request count read from /metrics."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import uvicorn
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"


class RunningServer:
    """uvicorn serving `app` on its own thread until `stop()`."""

    def __init__(self, app: Any) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        self.app = app

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.status("GET", "/health") == 200:
                return
            time.sleep(0.1)
        raise TimeoutError("the server never became healthy")

    def request(
        self, method: str, path: str, body: Any = None, key: str | None = API_KEY, raw: bytes | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()
        except (ConnectionError, urllib.error.URLError):
            return 0, {}, b""

    def status(self, method: str, path: str) -> int:
        return self.request(method, path)[0]

    def running_requests(self) -> float:
        status, _, body = self.request("GET", "/metrics")
        assert status == 200
        for family in text_string_to_metric_families(body.decode()):
            if family.name == "optimum_qwen36:num_requests_running":
                return sum(sample.value for sample in family.samples)
        raise AssertionError("no num_requests_running metric")

    def wait_until_idle(self) -> None:
        """Until no request runs in the engine and none is in flight in the server (10 s at most)."""
        state = self.app.state.server
        deadline = time.monotonic() + 10
        while (self.running_requests() or state.in_flight) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.running_requests() == 0 and state.in_flight == 0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
