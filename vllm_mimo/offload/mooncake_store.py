"""The plugin's client of Mooncake Store, the shared third KV tier (L3): whole host pages, each
under one key, copied between the store and the rows of one registered host buffer (zero-copy:
Mooncake's transfer engine reads and writes the registered rows itself).

Metadata: by default `P2PHANDSHAKE`, where clients exchange their segment descriptors directly
and no metadata server runs at all (the master's built-in HTTP metadata server binds 0.0.0.0
whatever its host flag says). The store itself evicts when its memory runs short: a put that
finds no room fails for that key (False here), and the master's eviction thread frees the pages
least recently leased (`--eviction_high_watermark_ratio`, `--eviction_ratio`; a read leases a
key for `--default_kv_lease_ttl`, during which it is not evicted).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_mimo.config import L3_MIN_GIB, P2P_HANDSHAKE, MimoConfig, metadata_address, split_address

MIN_SEGMENT_BYTES = int(L3_MIN_GIB * (1 << 30))
"""Mooncake refuses a smaller global segment than this (0, contributing none, is allowed)."""


class L3Unavailable(RuntimeError):
    """The Mooncake master (or the metadata service) cannot be reached, or the client's setup or
    buffer registration failed."""


@dataclass(frozen=True)
class L3Settings:
    """Where the store is and what this instance gives it."""

    master: str
    """The master's `host:port`."""
    metadata: str = P2P_HANDSHAKE
    """`P2PHANDSHAKE`, or the metadata service's URL (`http://host:port/metadata`, `etcd://host:port`,
    `redis://host:port`)."""
    gib: float = 0.0
    """Host memory this instance contributes to the store (its workers' global segments)."""
    local_hostname: str = ""
    """The address other clients reach this one at; empty: this host's address on its route to
    the master (127.0.0.1 for a master on loopback)."""
    protocol: str = "tcp"
    connect_timeout_s: float = 5.0
    """The bound on reaching the master (and the metadata service) before setup."""
    setup_timeout_s: float = 6.0
    """The bound on a trial setup against the master (`_check_master`) before the real one."""

    @classmethod
    def of(cls, config: MimoConfig) -> L3Settings | None:
        """The L3's settings from the plugin's config, None without one (`l3_master` empty)."""
        if not config.l3_master:
            return None
        return cls(master=config.l3_master, metadata=config.l3_metadata, gib=config.l3_gib)


def l3_key(model: str, layout: str, tp_rank: int, kind: str, group: int | str, block_hash: bytes | int | str) -> str:
    """A page's name in the store: `model|layout|tp<rank>|<kind><group>|<hash hex>`.

    `model` and `layout` must be printable without `|` (so that distinct names never collide);
    a bytes or int hash is written in hex, a str one as it is.
    """
    for name, value in (("model", model), ("layout", layout), ("kind", kind), ("group", str(group))):
        if not value.isprintable() or "|" in value:
            raise ValueError(f"l3_key: {name}={value!r} must be printable and contain no '|'")
    if isinstance(block_hash, bytes):
        digest = block_hash.hex()
    elif isinstance(block_hash, int):
        digest = f"{block_hash:x}"
    else:
        digest = block_hash
    return f"{model}|{layout}|tp{tp_rank}|{kind}{group}|{digest}"


def _probe(host: str, port: int, what: str, timeout_s: float) -> None:
    """Fail fast: Mooncake's own setup retries an unreachable master for about 90 s, holding the
    GIL (so no thread can bound it). A port that accepts connections but is no master still
    takes that long to fail."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise L3Unavailable(f"the Mooncake {what} at {host}:{port} cannot be reached ({e})") from None


_TRIAL_SETUP = (
    "import sys\n"
    "from mooncake.store import MooncakeDistributedStore\n"
    "rc = MooncakeDistributedStore().setup(sys.argv[1], sys.argv[2], 0, 0, sys.argv[3], '', sys.argv[4])\n"
    "sys.exit(0 if rc == 0 else 3)\n"
)


def _check_master(settings: L3Settings, local: str) -> None:
    """Fail fast on a port that accepts connections but is no master: Mooncake's setup then
    waits 60-90 s holding the GIL, so a trial setup runs in a child process, bounded by
    `setup_timeout_s` (about a second against a master)."""
    args = [sys.executable, "-c", _TRIAL_SETUP, local, settings.metadata, settings.protocol, settings.master]
    try:
        proc = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, timeout=settings.setup_timeout_s)
    except subprocess.TimeoutExpired:
        raise L3Unavailable(
            f"{settings.master} accepts connections but did not complete a Mooncake Store setup within "
            f"{settings.setup_timeout_s:g} s: is a Mooncake master listening there?"
        ) from None
    if proc.returncode != 0:
        raise L3Unavailable(
            f"a trial Mooncake Store setup against the master at {settings.master} failed (exit code {proc.returncode})"
        )


def _local_hostname(host: str, port: int) -> str:
    """This host's address on its route to the master (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


class MooncakeL3:
    """One client of the store. `segment_bytes` is the memory it contributes (0 or at least
    `MIN_SEGMENT_BYTES`); pages move between the store and the rows of the one buffer given to
    `register`."""

    def __init__(self, settings: L3Settings, segment_bytes: int) -> None:
        if 0 < segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes={segment_bytes} is below Mooncake's minimum of {MIN_SEGMENT_BYTES} (or 0)")
        self.settings = settings
        host, port = split_address(settings.master)
        _probe(host, port, "master", settings.connect_timeout_s)
        meta = metadata_address(settings.metadata)
        if meta is not None:
            _probe(*meta, "metadata service", settings.connect_timeout_s)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise L3Unavailable(f"Mooncake's store client cannot be imported ({e}); `make setup` installs it") from None
        self._store: Any = MooncakeDistributedStore()
        local = settings.local_hostname or _local_hostname(host, port)
        _check_master(settings, local)
        # local_buffer_size 0: every transfer goes from or to the registered buffer.
        rc = self._store.setup(local, settings.metadata, segment_bytes, 0, settings.protocol, "", settings.master)
        if rc != 0:
            raise L3Unavailable(
                f"Mooncake Store setup failed (code {rc}) with master {settings.master}, metadata "
                f"{settings.metadata}, local address {local}"
            )
        self.buffer: torch.Tensor | None = None
        """The registered host pages."""

    def register(self, buffer: torch.Tensor) -> None:
        """Register host pages (uint8, shape (pages, page_bytes), contiguous, on the CPU) for
        zero-copy transfers; once per client. L3Unavailable if Mooncake refuses it."""
        if self.buffer is not None:
            raise RuntimeError("MooncakeL3.register: a buffer is already registered")
        if buffer.dtype != torch.uint8 or buffer.dim() != 2 or not buffer.is_contiguous() or buffer.device.type != "cpu":
            raise ValueError(
                f"MooncakeL3.register needs a contiguous CPU uint8 (pages, page_bytes) tensor, got "
                f"{buffer.dtype} {tuple(buffer.shape)} on {buffer.device}"
            )
        rc = self._store.register_buffer(buffer.data_ptr(), buffer.numel())
        if rc != 0:
            raise L3Unavailable(f"Mooncake refused to register {buffer.numel()} bytes of host pages (code {rc})")
        self.buffer = buffer

    def reachable(self, timeout_s: float = 0.2) -> bool:
        """Whether the master accepts a connection now (its client reconnects by itself once it
        does; while it does not, a transfer waits about 4 s before it fails: `L3Watch` asks this
        first)."""
        try:
            _probe(*split_address(self.settings.master), "master", timeout_s)
        except L3Unavailable:
            return False
        return True

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether the store holds each key (an error counts as no)."""
        if not keys:
            return []
        return [r == 1 for r in self._store.batch_is_exist(list(keys))]

    def put_pages(self, keys: Sequence[str], pages: Sequence[int]) -> list[bool]:
        """Store buffer row `pages[i]` under `keys[i]`; False where the store had no room or failed.
        A key already stored keeps its page (True)."""
        return [r == 0 for r in self._transfer(self._store.batch_put_from, keys, pages)]

    def get_pages(self, keys: Sequence[str], pages: Sequence[int]) -> list[bool]:
        """Read `keys[i]` into buffer row `pages[i]`; True only for a whole page. A row whose key is
        False (missing, evicted, another size, failed) holds no valid page afterwards."""
        page_bytes = self._rows().shape[1]
        return [r == page_bytes for r in self._transfer(self._store.batch_get_into, keys, pages)]

    def close(self) -> None:
        """Unregister the buffer and leave the store (this client's segment and its pages go)."""
        if self._store is None:
            return
        if self.buffer is not None:
            self._store.unregister_buffer(self.buffer.data_ptr())
            self.buffer = None
        self._store.close()
        self._store = None

    def __enter__(self) -> MooncakeL3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rows(self) -> torch.Tensor:
        if self.buffer is None:
            raise RuntimeError("MooncakeL3: register() a buffer before moving pages")
        return self.buffer

    def _transfer(self, op: Any, keys: Sequence[str], pages: Sequence[int]) -> list[int]:
        rows = self._rows()
        if len(keys) != len(pages):
            raise ValueError(f"MooncakeL3: {len(keys)} keys for {len(pages)} pages")
        if not keys:
            return []
        num_pages, page_bytes = rows.shape
        bad = [p for p in pages if not 0 <= p < num_pages]
        if bad:
            raise IndexError(f"MooncakeL3: pages {bad[:5]} outside the registered 0..{num_pages - 1}")
        base = rows.data_ptr()
        return list(op(list(keys), [base + p * page_bytes for p in pages], [page_bytes] * len(pages)))
