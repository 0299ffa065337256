"""eval/sglang_peer.py: SGLang's own cache in the replay, on a trace whose hits are known by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval import replay, sglang_peer
from eval.layouts import LAYOUTS
from eval.workloads import ReplayRequest, Segment, previous_turns

ROOT = Path(__file__).resolve().parents[1]
SYSTEM, USER1, ANSWER1 = Segment(11, 512), Segment(12, 100), Segment(13, 50)


def _session() -> list[ReplayRequest]:
    """A (system 512 + question 100, answers 50), B (the same system, another question: a branch
    at 512), then A's second turn (A's prompt and answer + 60), each alone in the engine."""
    return [
        ReplayRequest(0.0, (SYSTEM, USER1), ANSWER1),
        ReplayRequest(10.0, (SYSTEM, Segment(14, 200)), Segment(15, 5)),
        ReplayRequest(20.0, (SYSTEM, USER1, ANSWER1, Segment(16, 60)), Segment(17, 5)),
    ]


def _hits(engine: str) -> tuple[list[int], replay.RunResult]:
    requests = _session()
    result = replay.simulate(
        engine, "mimo-v2.5-pro", 4, requests, replay.ideal_hits(requests), replay.SimParams(), progress=False
    )
    return [result.first_tokens[str(i)].hit_tokens for i in range(len(requests))], result


@pytest.mark.parametrize("engine", ["sglang-r0.8", "sglang-r0.05", "sglang-unified", "sglang-r0.8-norefresh"])
def test_sglang_hits_on_a_hand_made_session_are_the_predicted_ones(engine):
    """SGLang keeps a request's SWA KV only within a window (and a page) of where its prefill
    or its decode stands, the rest are tombstones (Full KV kept):

    - A prefills 612 tokens in one chunk; its checkpoint frees SWA below 611 - 128, page-floored
      to 480. It finishes with 661 tokens computed (612 + 49 decoded; fewer than 128 past the
      window, so no decode eviction) and inserts them page-aligned: 656.
    - B shares 512 tokens with A, but [384, 512) is not all live: the Full layers had 512, the
      hit is 0 (a pseudo hit of 512).
    - A's second turn starts with A's 662 tokens: the 656 A inserted match, and [528, 656) is live.
    """
    assert previous_turns(_session()) == [None, None, 0]
    hits, result = _hits(engine)
    assert hits == [0, 0, 656]
    assert result.hit_tokens == 656 and result.full_hit_tokens == 512 + 656 and result.pseudo_hit_tokens == 512
    assert result.preemptions == 0 and result.ttft_mean_s > 0


def test_the_plugin_and_upstream_on_the_same_session():
    """The plugin's grid anchor of A at 512 serves the branch; its next-turn anchor serves A's
    second turn. Upstream r0 learns the junction at 512 only when B pays for it, and keeps SWA
    tails at prompt ends only, so A's second turn hits the end of A's prompt (612 in whole
    blocks: 608), not of its answer."""
    assert _hits("mimo")[0] == [0, 512, 656]
    assert _hits("upstream-r0")[0] == [0, 0, 608]


def test_pool_sizes_are_sglang_configurators():
    """At 4 GiB, mimo-v2.5-pro (10 Full + 60 SWA layers of 8 KV heads x (128 + 128) in bf16):
    a Full token costs 10 x 4096 bytes, an SWA token 60 x 4096, and SGLang buys Full tokens
    at 10 x 4096 + R x 60 x 4096 bytes each, page-aligned."""
    for ratio in (0.8, 0.2, 0.05):
        sizes = sglang_peer.pool_sizes(LAYOUTS["mimo-v2.5-pro"], 4 << 30, sglang_peer.PeerSpec(ratio))
        full = int((4 << 30) // (40960 + ratio * 245760)) // 16 * 16
        assert (sizes.full_tokens, sizes.swa_tokens) == (full, int(full * ratio) // 16 * 16)
        peer = sglang_peer.SGLangPeer(LAYOUTS["mimo-v2.5-pro"], 4 << 30, sglang_peer.PeerSpec(ratio), 8, 4096, 8192)
        assert (peer.allocator.size_full, peer.allocator.size_swa) == (sizes.full_tokens, sizes.swa_tokens)
        assert peer.held_pages() == {"full": 0, "swa": 0}
    # The unified pool shares the bytes: either kind alone may take what the other leaves (less
    # the pages SGLang keeps back as sinks and slack: within 0.5%).
    peer = sglang_peer.SGLangPeer(LAYOUTS["mimo-v2.5-pro"], 4 << 30, sglang_peer.PeerSpec(None), 8, 4096, 8192)
    assert peer.allocator.size_full == pytest.approx((4 << 30) / 40960, rel=5e-3)
    assert peer.allocator.size_swa == pytest.approx((4 << 30) / 245760, rel=5e-3)


def test_engine_names_and_a_missing_install(tmp_path, capsys):
    assert sglang_peer.parse_engine("sglang-r0.05") == sglang_peer.PeerSpec(0.05)
    assert sglang_peer.parse_engine("sglang-unified-norefresh") == sglang_peer.PeerSpec(None, waiting_refresh=False)
    assert sglang_peer.parse_engine("sglang") is None and sglang_peer.parse_engine("mimo") is None
    args = ["--trace", str(ROOT / "tests/data/siblings.jsonl"), "--layout", "mimo-v2.5-pro", "--kv-gib", "4"]
    with pytest.raises(SystemExit):
        replay.main([*args, "--engines", "sglang-r1.5"])
    assert "swa_full_tokens_ratio must be in (0, 1], got 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replay.main([*args, "--engines", "sglang-r"])
    assert "sglang-r<RATIO>" in capsys.readouterr().err
    env = dict(os.environ, VLLM_MIMO_SGLANG_SITE=str(tmp_path / "nowhere"))
    run = subprocess.run([sys.executable, "-m", "eval.replay", *args, "--engines", "sglang-r0.8"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "run `make sglang`" in run.stderr


def test_sglang_engines_in_the_json_beside_the_others(tmp_path):
    out = tmp_path / "replay.json"
    assert replay.main(["--workload", "shared-system-prompt", "--layout", "mimo-v2.5-pro", "--kv-gib", "2",
                        "--max-requests", "60", "--engines", "upstream-r512,sglang-r0.2,mimo",
                        "--json", str(out), "--quiet"]) == 0
    runs = {r["engine"]: r for r in json.loads(out.read_text())["runs"]}
    sglang = runs["sglang-r0.2"]
    assert sglang["prompt_tokens"] == runs["mimo"]["prompt_tokens"] and sglang["num_blocks"] == runs["mimo"]["num_blocks"]
    assert 0 < sglang["hit_tokens"] <= sglang["full_hit_tokens"] <= sglang["ideal_hit_tokens"]
    assert sglang["pseudo_hit_tokens"] == sglang["full_hit_tokens"] - sglang["hit_tokens"]
    assert set(sglang["peak_blocks"]) == {"full", "swa"}


@pytest.mark.parametrize("engine,workload,count,gib", [
    ("sglang-r0.8", "mixed", 80, 3),
    # Where a chunk fits each side of the unified pool alone but not both together.
    pytest.param("sglang-unified-norefresh", "agent-sessions", None, 4, marks=pytest.mark.slow),  # the whole workload
])
def test_sglang_under_memory_pressure_retracts_and_ends_clean(engine, workload, count, gib):
    """Budgets where SGLang's memory is short (3 GiB: 13.5K Full tokens at ratio 0.8, whose
    decode retracts once; the unified pool's Full and SWA share the bytes, so every allocation
    checks their joint room): retracted requests come back and match again, and at the end
    every page is free or in the tree and SGLang's own tree check passes (`check_idle`, run by
    the replay after the last request)."""
    from eval.workloads import make_workload

    requests = make_workload(workload, seed=0)[:count]
    result = replay.simulate(engine, "mimo-v2.5-pro", gib, requests, replay.ideal_hits(requests),
                             replay.SimParams(), progress=False)
    assert result.hit_tokens > 0 and (result.preemptions > 0 or engine != "sglang-r0.8")
    assert len(result.first_tokens) == len(requests)
