"""The L3's Mooncake Store client against a real master on loopback, and the L3's config keys."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from tests.kv_helpers import BLOCK, DictL3, first_session_through_host, make_request, manager, others_through_host
from vllm_mimo.config import MimoConfig, MimoConfigError
from vllm_mimo.offload.mooncake_store import L3Settings, L3Unavailable, MooncakeL3, l3_key
from vllm_mimo.testing.mooncake import mooncake_available, mooncake_master
from vllm_mimo.testing.server import free_port

PAGE = 64 << 10
SEGMENT = 64 << 20

WHY_NOT = mooncake_available()
needs_mooncake = pytest.mark.skipif(WHY_NOT is not None, reason=f"no Mooncake Store: {WHY_NOT}")


MASTER = pytest.mark.slow
"""Tests that start a real `mooncake_master` or Mooncake client (seconds each: the slow lane)."""


@pytest.fixture(scope="module")
def store():
    with mooncake_master() as running:
        yield running


@pytest.fixture(scope="module")
def pair(store):
    """Two clients of `store`, each giving it a segment (a client's close takes 1-2 s)."""
    with _client(store) as a, _client(store) as b:
        yield a, b


def _client(store, pages: int = 16, page_bytes: int = PAGE, segment: int = SEGMENT) -> MooncakeL3:
    client = MooncakeL3(L3Settings(master=store.master, metadata=store.metadata), segment_bytes=segment)
    client.register(torch.zeros((pages, page_bytes), dtype=torch.uint8))
    return client


def _rows(client: MooncakeL3) -> torch.Tensor:
    assert client.buffer is not None
    return client.buffer


def _keys(name: str, n: int) -> list[str]:
    return [l3_key("tiny-mimo", "abc123", 0, "full", 0, f"{name}{i}".encode()) for i in range(n)]


@needs_mooncake
@MASTER
def test_put_get_round_trip_and_contains(pair):
    a, b = pair
    _rows(a).copy_(torch.randint(0, 256, _rows(a).shape, dtype=torch.uint8))
    keys = _keys("rt", 4)
    assert a.contains(keys) == [False] * 4
    assert a.put_pages(keys, [3, 0, 7, 5]) == [True] * 4
    assert a.contains([*keys, *_keys("absent", 1)]) == [True] * 4 + [False]
    assert b.get_pages(keys, [0, 1, 2, 3]) == [True] * 4
    assert torch.equal(_rows(b)[:4], _rows(a)[[3, 0, 7, 5]])
    assert a.put_pages([], []) == a.get_pages([], []) == a.contains([]) == []


@needs_mooncake
@MASTER
def test_two_clients_see_each_others_puts(pair):
    a, b = pair
    _rows(a)[0].fill_(1)
    _rows(b)[0].fill_(2)
    ka, kb = _keys("from-a", 1), _keys("from-b", 1)
    assert a.put_pages(ka, [0]) == [True] and b.put_pages(kb, [0]) == [True]
    assert b.contains(ka) == a.contains(kb) == [True]
    assert a.get_pages(kb, [1]) == b.get_pages(ka, [1]) == [True]
    assert bool((_rows(a)[1] == 2).all()) and bool((_rows(b)[1] == 1).all())


@needs_mooncake
@MASTER
def test_putting_a_stored_key_again_is_harmless(pair):
    a, _ = pair
    _rows(a)[0].fill_(5)
    _rows(a)[1].fill_(6)
    key = _keys("again", 1)
    assert a.put_pages(key, [0]) == [True]
    assert a.put_pages(key, [1]) == [True]
    assert a.get_pages(key, [2]) == [True]
    assert bool((_rows(a)[2] == 5).all())  # the first page stays


@needs_mooncake
@MASTER
def test_missing_or_other_size_is_false(store, pair):
    a, _ = pair
    with _client(store, page_bytes=PAGE // 2, segment=0) as small, _client(store, page_bytes=PAGE * 2, segment=0) as big:
        key = _keys("sized", 1)
        assert a.put_pages(key, [0]) == [True]
        assert a.get_pages(_keys("missing", 2), [1, 2]) == [False, False]
        assert small.get_pages(key, [0]) == [False]  # the page does not fit
        assert big.get_pages(key, [0]) == [False]  # a short read is no page


@needs_mooncake
@MASTER
def test_a_full_store_refuses_puts_and_never_returns_wrong_bytes():
    """Three times more pages than the store's only segment (16 MiB) holds: some puts fail, and
    every page read back whole is the page put under its key."""
    n = 768
    with mooncake_master() as own, _client(own, pages=n, segment=16 << 20) as writer, _client(own, pages=n, segment=0) as reader:
        for i in range(n):
            _rows(writer)[i].fill_(i % 251)
        _rows(reader).fill_(255)
        keys = _keys("full", n)
        assert 0 < sum(writer.put_pages(keys, range(n))) < n
        got = reader.get_pages(keys, range(n))
        assert sum(got) > 0
        for i in (i for i, hit in enumerate(got) if hit):
            assert bool((_rows(reader)[i] == i % 251).all()), f"page {i}"


@needs_mooncake
@MASTER
def test_register_rejects_a_buffer_that_is_not_host_pages(store):
    with MooncakeL3(L3Settings(master=store.master), segment_bytes=0) as client:
        with pytest.raises(RuntimeError, match="register"):
            client.put_pages(_keys("x", 1), [0])
        with pytest.raises(ValueError, match="contiguous CPU uint8"):
            client.register(torch.zeros((4, 8), dtype=torch.float32))
        client.register(torch.zeros((4, PAGE), dtype=torch.uint8))
        with pytest.raises(IndexError, match="outside"):
            client.put_pages(_keys("x", 1), [4])
        with pytest.raises(ValueError, match="2 keys for 1 pages"):
            client.put_pages(_keys("x", 2), [0])


@MASTER
def test_unreachable_master_fails_fast():
    start = time.monotonic()
    with pytest.raises(L3Unavailable, match=r"master at 127\.0\.0\.1:\d+ cannot be reached"):
        MooncakeL3(L3Settings(master=f"127.0.0.1:{free_port()}"), segment_bytes=0)
    assert time.monotonic() - start < 5


@MASTER
def test_unreachable_metadata_service_fails_fast():
    with socket.create_server(("127.0.0.1", 0)) as master:  # accepts connections, serves nothing
        settings = L3Settings(master=f"127.0.0.1:{master.getsockname()[1]}", metadata=f"http://127.0.0.1:{free_port()}/metadata")
        with pytest.raises(L3Unavailable, match=r"metadata service at 127\.0\.0\.1:\d+ cannot be reached"):
            MooncakeL3(settings, segment_bytes=0)


@needs_mooncake
@MASTER
def test_a_port_that_is_no_master_fails_within_seconds_naming_it():
    """It accepts connections, so the reachability probe passes; Mooncake's own setup would then
    hang 60-90 s holding the GIL. The trial setup in a child process bounds it."""
    with socket.create_server(("127.0.0.1", 0)) as fake:
        address = f"127.0.0.1:{fake.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(L3Unavailable, match=rf"{address} accepts connections but did not complete a Mooncake Store setup"):
            MooncakeL3(L3Settings(master=address, setup_timeout_s=3.0), segment_bytes=0)
        assert time.monotonic() - start < 8


@MASTER
def test_segment_below_mooncakes_minimum_is_refused():
    with pytest.raises(ValueError, match="below Mooncake's minimum"):
        MooncakeL3(L3Settings(master="127.0.0.1:1"), segment_bytes=1 << 20)


@needs_mooncake
@MASTER
def test_master_that_cannot_start_reports_its_log():
    with pytest.raises(RuntimeError, match="mooncake_master exited with code .*\n.*no_such_flag"):
        with mooncake_master(extra_args=["--no_such_flag=1"]):
            pass


def test_l3_key_is_short_printable_and_distinct():
    key = l3_key("tiny-mimo", "abc123", 1, "swa", "2.1", bytes(range(4)))
    assert key == "tiny-mimo|abc123|tp1|swa2.1|00010203"
    assert l3_key("m", "l", 0, "full", 0, 255) == "m|l|tp0|full0|ff"
    assert len({l3_key("m", "l", r, k, g, 7) for r in (0, 1) for k in ("full", "swa") for g in (0, 1)}) == 8
    with pytest.raises(ValueError, match=r"model='a\|b'"):
        l3_key("a|b", "l", 0, "full", 0, 1)


# --- config -----------------------------------------------------------------------------------

HOST_TIER = {"host_tier_gib": 1}


def test_l3_settings_from_config():
    assert L3Settings.of(MimoConfig.from_sources(None, environ={})) is None
    cfg = MimoConfig.from_sources({"mimo": {**HOST_TIER, "l3_master": "10.0.0.5:50051", "l3_gib": 4}}, environ={})
    assert L3Settings.of(cfg) == L3Settings(master="10.0.0.5:50051", metadata="P2PHANDSHAKE", gib=4.0)
    env = {"VLLM_MIMO_HOST_TIER_GIB": "1", "VLLM_MIMO_L3_MASTER": "store:1", "VLLM_MIMO_L3_METADATA": "http://meta:8080/metadata"}
    assert L3Settings.of(MimoConfig.from_sources(None, environ=env)) == L3Settings("store:1", "http://meta:8080/metadata", 0.0)


@pytest.mark.parametrize(
    "section,message",
    [
        ({"l3_master": "10.0.0.5"}, r"additional_config.mimo.l3_master='10.0.0.5' is malformed; allowed: \"\" or host:port"),
        ({"l3_master": "host:0"}, r"l3_master='host:0' is malformed"),
        ({"l3_master": ":50051"}, r"l3_master=':50051' is malformed"),
        ({"l3_master": 50051}, r"l3_master=50051 has type int; expected str"),
        ({"l3_master": "h:1", "l3_metadata": "meta:8080"}, r"l3_metadata='meta:8080' is malformed; allowed: P2PHANDSHAKE or"),
        ({"l3_master": "h:1", "l3_metadata": "ftp://meta:8080"}, r"l3_metadata='ftp://meta:8080' is malformed"),
        ({"l3_master": "h:1", "l3_gib": -1}, r"l3_gib=-1.0 is out of range; allowed: 0 or 0.015625 <= value <= 1048576.0"),
        ({"l3_master": "h:1", "l3_gib": 0.01}, r"l3_gib=0.01 is below Mooncake's 16 MiB segment minimum; allowed: 0 or"),
    ],
)
def test_bad_l3_values_name_the_value_and_the_allowed_ones(section, message):
    with pytest.raises(MimoConfigError, match=message):
        MimoConfig.from_sources({"mimo": {**HOST_TIER, **section}}, environ={})


def test_bad_l3_environment_value():
    with pytest.raises(MimoConfigError, match=r"VLLM_MIMO_L3_GIB='lots' is not a float"):
        MimoConfig.from_sources(None, environ={"VLLM_MIMO_L3_GIB": "lots"})


def test_l3_needs_the_host_tier():
    with pytest.raises(MimoConfigError, match=r"l3_master='h:1' needs the host tier, but host_tier_gib=0"):
        MimoConfig.from_sources({"mimo": {"l3_master": "h:1"}}, environ={})


def test_host_tier_and_l3_memory_beyond_the_machine_are_refused_at_startup_with_the_numbers(tiny_models):
    """Each fits alone; together they do not: vLLM's config build (what `LLM()` and `vllm serve`
    do first) refuses them, naming both values, their sum and the machine's memory."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_mimo.offload import machine_memory_gib

    half = round(machine_memory_gib() * 0.6, 1)
    section = {"host_tier_gib": half, "l3_master": "127.0.0.1:1", "l3_gib": half}
    args = EngineArgs(model=str(tiny_models["mimo"]), enforce_eager=True, max_model_len=2048,
                      additional_config={"mimo": section})
    with pytest.raises(Exception, match=rf"host_tier_gib={half:g} plus l3_gib={half:g} \({2 * half:g} GiB of host "
                       rf"memory\) is more than this machine's memory \(\d+\.\d GiB\); allowed: host_tier_gib \+ l3_gib <= "):
        args.create_engine_config()


def test_l3_keys_without_a_master_are_an_error():
    with pytest.raises(MimoConfigError, match=r"l3_gib=2.0: there is no L3 \(l3_master=\"\"\)"):
        MimoConfig.from_sources({"mimo": {**HOST_TIER, "l3_gib": 2}}, environ={})



# --- one store lookup per admission -------------------------------------------------------------


class _CountingIndex:
    """The host tier's `L3Index` on a real client of the store, counting its round trips."""

    def __init__(self, client: MooncakeL3) -> None:
        self.client = client
        self.calls = 0

    def key(self, kind: str, index: int, block_hash) -> str:
        return l3_key("count-test", "abc123", 0, kind, index, block_hash)

    def contains(self, keys) -> list[bool]:
        self.calls += 1
        return self.client.contains(list(keys))


@needs_mooncake
@MASTER
def test_an_admission_asks_the_store_once_and_a_waiting_request_not_again_until_the_interval_passes(pair):
    """The lookup's L3 answer is carried into the admission (no second question), and a request
    that waits asks again only once the answers are `answer_ttl_s` old."""
    a, _ = pair
    index = _CountingIndex(a)
    writer = manager(40, host_pages=40)
    writer.attach_l3(DictL3())
    first = first_session_through_host(writer)
    others_through_host(writer, 12)  # the first session goes to L3 (keys in the DictL3)
    put = sorted(index.key(*key) for key in writer.host_tier.l3.index.keys)
    assert put and all(a.put_pages(put[i : i + 8], list(range(len(put[i : i + 8])))) for i in range(0, len(put), 8))

    now = [0.0]
    reader = manager(40, host_pages=40)
    reader.attach_l3(index, answer_ttl_s=1.0, clock=lambda: now[0])
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    blocks, hit, _ = reader.get_computed_blocks(turn)
    external = reader.host_extension(turn)
    asked = index.calls
    assert external == (first.num_tokens - 1) // BLOCK * BLOCK and 1 <= asked <= 2, (external, asked)
    for _ in range(5):  # waiting for room: looked up every step, the answers still fresh
        reader.get_computed_blocks(turn)
        assert reader.host_extension(turn) == external
    assert index.calls == asked
    now[0] = 1.5  # the interval passed: the next lookup asks again
    blocks, hit, _ = reader.get_computed_blocks(turn)
    assert reader.host_extension(turn) == external and index.calls == 2 * asked
    now[0] = 3.0  # the answers are stale again: only the lookup's extension, carried, spares a question
    new = reader.allocate_slots(turn, turn.num_tokens - hit - external, hit, blocks, num_external_computed_tokens=external)
    assert new is not None and index.calls == 2 * asked
    plan = reader.take_load(turn.request_id)
    assert plan is not None and plan.fetches and not plan.failed
    reader.finish_load(plan)
    assert reader.host_tier.l3.counts.store_calls == index.calls


# --- the master going away ---------------------------------------------------------------------


class _Master:
    """A client's view of whether the master accepts connections (`MooncakeL3.reachable`)."""

    def __init__(self) -> None:
        self.up = True
        self.asked = 0

    def reachable(self) -> bool:
        self.asked += 1
        return self.up


def test_the_watch_asks_the_master_before_a_steps_transfers_so_none_waits_on_a_dead_one():
    """A transfer to a master that died waits about 4 s before it fails; a refused connection
    takes microseconds. So a step that moves pages asks first (one connection), and one that
    moves none asks nothing while the master is up; while it is down, it is asked again every
    `recheck_s`, and a failed transfer makes the watch ask at once."""
    from vllm_mimo.offload.l3_index import L3Watch

    master, now = _Master(), [0.0]
    watch = L3Watch(master, recheck_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert watch.check() and master.asked == 0  # no transfers this step: no question
    assert watch.check(transfers=True) and master.asked == 1
    master.up = False  # killed between two steps
    assert not watch.check(transfers=True) and master.asked == 2  # found before any transfer is tried
    assert not watch.check(transfers=True) and master.asked == 2  # down: not asked again within recheck_s
    master.up, now[0] = True, 1.0
    assert watch.check() and master.asked == 3  # back, found at the recheck without a transfer
    master.up = False
    watch.failed()  # a transfer failed within a step
    assert not watch.up and master.asked == 4
