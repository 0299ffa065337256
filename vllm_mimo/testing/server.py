"""Start and stop a local `vllm serve` for demos, tests and benchmarks."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`vllm serve MODEL` on 127.0.0.1 in a subprocess; a context manager.

    The server's output goes to `log_path` (a temporary file unless given); `log_text()` reads it.
    """

    def __init__(
        self,
        model: str | Path,
        *extra_args: str,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = list(extra_args)
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def command(self) -> list[str]:
        vllm = Path(sys.executable).with_name("vllm")
        return [str(vllm), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]

    def start(self) -> VllmServer:
        self._log = open(self.log_path, "wb")
        self._proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # so stop() reaches the engine and worker processes too
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {self._proc.returncode} during startup: "
                    f"{self.root_cause()}\nfull log: {self.log_path}; last log lines:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"vllm serve did not become healthy in {self.startup_timeout_s:.0f} s; "
            f"last log lines:\n{self.tail()}"
        )

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGINT)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def root_cause(self) -> str:
        """The first exception message in the log (vLLM's engine errors come before the wrappers')."""
        for line in self.log_text().splitlines():
            found = _EXCEPTION.match(line)
            if found:
                return found.group(1)
        return "no exception in the log"

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """Prometheus samples from /metrics, summed over labels: {name: value}."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return parse_prometheus(text)


# A traceback's last line, bare or behind vLLM's "(EngineCore pid=N) ERROR <time> [file:line] " prefix.
_EXCEPTION = re.compile(r"^(?:\(.*?\) ERROR .*?\] )?([A-Z]\w*(?:Error|Exception): .*)$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum each metric's samples over their label sets."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    return totals
