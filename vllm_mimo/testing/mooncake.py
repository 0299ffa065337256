"""A Mooncake Store master on loopback for tests: `with mooncake_master() as store: ...`.

It runs the `mooncake_master` binary of the `mooncake-transfer-engine-non-cuda` wheel with its
RPC and metrics servers bound to 127.0.0.1, and no metadata server: clients use P2PHANDSHAKE
(the master's built-in HTTP metadata server would bind 0.0.0.0 whatever its host flag says).
`make setup` installs the wheel and `libibverbs.so.1`, which Mooncake links even for TCP.
"""

from __future__ import annotations

import ctypes
import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vllm_mimo.config import P2P_HANDSHAKE
from vllm_mimo.testing.server import free_port

READY_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class MooncakeMaster:
    """A running master: what `L3Settings` needs to reach it."""

    master: str
    metadata: str
    log_path: Path
    pid: int
    """The master's process (a fault test kills it)."""
    args: tuple[str, ...]
    """How it was started (a fault test starts it again on the same port)."""


def mooncake_available() -> str | None:
    """Why a Mooncake Store cannot run here (for a skip message), or None if it can."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return "the mooncake-transfer-engine-non-cuda wheel is not installed (`make setup` installs it)"
    if not (Path(spec.submodule_search_locations[0]) / "mooncake_master").is_file():
        return "the mooncake wheel has no mooncake_master binary"
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return "libibverbs.so.1 is missing (Debian: apt-get install libibverbs1; `make setup` does)"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"Mooncake's store client cannot be imported: {e}"
    return None


@contextmanager
def mooncake_master(extra_args: Sequence[str] = ()) -> Iterator[MooncakeMaster]:
    """Start a master on free loopback ports, wait until it accepts connections (at most
    `READY_TIMEOUT_S`; RuntimeError with its log's tail otherwise), and stop it at exit.
    `extra_args`: more `mooncake_master` flags (`--default_kv_lease_ttl=...`)."""
    why = mooncake_available()
    if why is not None:
        raise RuntimeError(f"cannot start a Mooncake master: {why}")
    port = free_port()
    args = [
        sys.executable, "-m", "mooncake.cli",  # execs the wheel's binary (and makes it executable)
        "--rpc_address=127.0.0.1", f"--rpc_port={port}",
        "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}",
        "--enable_http_metadata_server=false", "--enable_metric_reporting=false",
        "--logtostderr",  # glog would write files under /tmp otherwise
        *extra_args,
    ]
    with tempfile.NamedTemporaryFile("w+b", prefix="mooncake-master-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(process, port, log_path)
        yield MooncakeMaster(f"127.0.0.1:{port}", P2P_HANDSHAKE, log_path, process.pid, tuple(args))
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log_path.unlink(missing_ok=True)


def _wait_ready(process: subprocess.Popen, port: int, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with code {process.returncode}:\n{_tail(log_path)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"mooncake_master did not listen on 127.0.0.1:{port} within {READY_TIMEOUT_S:g} s:\n{_tail(log_path)}")


def _tail(log_path: Path, lines: int = 20) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
