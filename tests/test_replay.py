"""eval/replay.py: predicted hits on a hand-made trace, a smoke run, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import replay, replay_bound, replay_compare, replay_diagnose, replay_ends, replay_sensitivity, replay_ttft, replay_us
from eval.workloads import ReplayRequest, Segment, TraceError, make_workload, previous_turns, read_mooncake
from vllm_mimo.kv_cache.anchors import SPECULATIVE_KINDS
from vllm_mimo.kv_cache.contract import CacheObserver
from vllm_mimo.kv_cache.node import AnchorKind

DATA = Path(__file__).with_name("data")


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "replay.json"
    assert replay.main([*args, "--json", str(out), "--quiet"]) == 0
    return {(r["engine"], r["kv_gib"]): r for r in json.loads(out.read_text())["runs"]}


def test_hand_made_trace_hits_are_the_predicted_ones(tmp_path):
    """A: blocks [0,1]; B: the same again; C: [0,2]; D: [0,3] (512-token blocks, ample memory).

    upstream r0: B hits its prompt-end tail (1008 = 1023 rounded down to 16); C is the first
    sibling at the 512-token junction and gets nothing (the junction is learned then); D hits 512.
    mimo: the same 1008 for B, and C already hits 512 through A's grid anchor; so does D.
    """
    runs = _run(tmp_path, "--trace", str(DATA / "siblings.jsonl"), "--layout", "mimo-v2.5-pro",
                "--kv-gib", "4", "--engines", "upstream-r0,swa-free,mimo")
    assert runs[("upstream-r0", 4.0)]["hit_tokens"] == 1008 + 0 + 512
    assert runs[("upstream-r0", 4.0)]["pseudo_hit_tokens"] == 512
    assert runs[("mimo", 4.0)]["hit_tokens"] == 1008 + 512 + 512
    assert runs[("mimo", 4.0)]["pseudo_hit_tokens"] == 0
    assert runs[("swa-free", 4.0)]["hit_tokens"] == runs[("mimo", 4.0)]["ideal_hit_tokens"] == 2032
    # Each request runs alone and prefills in one step: TTFT = 20 ms + 50 us per computed token.
    def mean_ttft(hits: list[int]) -> float:
        return sum(0.02 + (1024 - hit) * 50e-6 for hit in hits) / len(hits)

    assert runs[("upstream-r0", 4.0)]["ttft_mean_s"] == pytest.approx(mean_ttft([0, 1008, 0, 512]))
    assert runs[("mimo", 4.0)]["ttft_mean_s"] == pytest.approx(mean_ttft([0, 1008, 512, 512]))


def test_smoke_run_on_a_small_workload(tmp_path):
    runs = _run(tmp_path, "--workload", "shared-system-prompt", "--layout", "mimo-v2.5-pro",
                "--kv-gib", "1", "4", "--max-requests", "40")
    assert {engine for engine, _ in runs} == set(replay.DEFAULT_ENGINES)
    for run in runs.values():
        for key in ("prompt_tokens", "ideal_hit_tokens", "hit_tokens", "pseudo_hit_tokens",
                    "recomputed_prefill_tokens", "peak_blocks", "mean_us_per_call", "ttft_mean_s", "ttft_p90_s"):
            assert key in run
        assert 0 <= run["hit_tokens"] <= run["ideal_hit_tokens"] <= run["prompt_tokens"]
        assert run["ttft_mean_s"] > 0 and run["ttft_p90_s"] > 0
    assert set(runs[("mimo", 4.0)]["peak_blocks"]) == {"swa", "full"}
    # Window-local SWA attention: a prefilling request holds its window, not its chunk.
    local, stock, r0 = (runs[(e, 4.0)]["peak_swa_blocks_per_request"] for e in ("mimo", "mimo-stock-attention", "upstream-r0"))
    assert 0 < 5 * local < stock and stock <= r0 and runs[("swa-free", 4.0)]["peak_swa_blocks_per_request"] == 0


def test_prefill_chunk_cap(tmp_path, capsys):
    """The cap holds while memory is short (1.5 GiB) and is lifted while a whole step fits in
    free blocks (64 GiB: as if there were none)."""
    args = ["--workload", "agent-sessions", "--layout", "mimo-v2.5-pro", "--kv-gib", "1.5", "64",
            "--max-requests", "30", "--engines", "mimo-stock-attention"]
    small, large, none = (
        _run(tmp_path, *args, "--prefill-chunk", chunk) for chunk in ("512", "8192", "0")
    )
    tight, ample = ("mimo-stock-attention", 1.5), ("mimo-stock-attention", 64.0)
    assert small[tight]["peak_swa_blocks_per_request"] < large[tight]["peak_swa_blocks_per_request"]
    same = ("hit_tokens", "peak_swa_blocks_per_request", "ttft_mean_s", "sim_seconds")
    assert [small[ample][k] for k in same] == [none[ample][k] for k in same]  # a static cap: higher TTFT
    with pytest.raises(SystemExit):
        replay.main([*args, "--prefill-chunk", "-1"])
    assert "--prefill-chunk must be >= 0" in capsys.readouterr().err


def test_the_plugin_replays_a_layout_whose_groups_have_different_block_sizes(tmp_path):
    """mimo-v2-flash: Full layers have half the SWA layers' KV heads, so vLLM gives the Full group
    32-token blocks and the SWA groups 16-token ones."""
    runs = _run(tmp_path, "--workload", "shared-system-prompt", "--layout", "mimo-v2-flash",
                "--kv-gib", "1", "--max-requests", "60", "--engines", "upstream-r0,mimo")
    mimo, r0 = runs[("mimo", 1.0)], runs[("upstream-r0", 1.0)]
    assert mimo["prompt_tokens"] == r0["prompt_tokens"]
    assert mimo["hit_tokens"] > r0["hit_tokens"] > 0
    assert mimo["hit_tokens"] % 32 == 0 and mimo["pseudo_hit_tokens"] < mimo["hit_tokens"] // 10


def test_a_next_turn_is_sent_when_the_answer_it_contains_is_complete():
    """Turn 2's timestamp falls while turn 1 still decodes its 200-token answer."""
    system, answer = Segment(11, 400), Segment(12, 200)
    turns = [
        ReplayRequest(0.0, (system,), answer),
        ReplayRequest(0.1, (system, answer, Segment(13, 50)), Segment(14, 5)),
    ]
    assert previous_turns(turns) == [None, 0]
    ideal = replay.ideal_hits(turns)
    assert ideal == [0, 592]  # 649 prompt tokens less the last, in whole 16-token blocks
    closed = replay.simulate("mimo", "mimo-v2.5-pro", 4, turns, ideal, replay.SimParams(), progress=False)
    assert closed.hit_tokens == 592
    # Sent when turn 1 finished (one prefill step, then 199 decode steps), prefilled in one step.
    turn1_ttft = 0.02 + 400 * 50e-6
    turn2_ttft = 0.02 + (650 - 592) * 50e-6
    assert closed.sim_seconds == pytest.approx(turn1_ttft + 199 * 0.02 + turn2_ttft + 4 * 0.02)
    assert closed.ttft_mean_s == pytest.approx((turn1_ttft + turn2_ttft) / 2)
    open_loop = replay.SimParams(closed_loop=False)
    early = replay.simulate("mimo", "mimo-v2.5-pro", 4, turns, ideal, open_loop, progress=False)
    assert early.hit_tokens < 592  # sent before the answer existed: only what was computed


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 2}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": -5, "output_length": 2, "hash_ids": [1]}', "non-negative"),
        ('{"timestamp": 0, "input_length": 1500, "output_length": 2, "hash_ids": [1, 2]}', "needs 3 hash ids"),
        ("not json", "not JSON"),
    ],
)
def test_malformed_trace_line_names_file_and_line(tmp_path, line, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=rf"bad.jsonl:2: .*{message}"):
        read_mooncake(trace)
    assert replay.main(["--trace", str(trace), "--layout", "mimo-v2.5-pro", "--kv-gib", "1"]) == 2


def test_unknown_layout_and_engine_list_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        replay.main(["--workload", "mixed", "--layout", "llama-70b", "--kv-gib", "1"])
    assert "known layouts: mimo-v2.5-pro" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replay.main(["--workload", "mixed", "--layout", "mimo-v2.5-pro", "--kv-gib", "1", "--engines", "lru"])
    assert "known engines: upstream-r0" in capsys.readouterr().err


def test_the_plugins_steps_are_cut_when_memory_is_short_as_its_scheduler_cuts_them(tmp_path, capsys):
    args = ["--workload", "agent-sessions", "--layout", "mimo-v2.5-pro", "--kv-gib", "1.5",
            "--max-requests", "30", "--engines", "swa-free,mimo-stock-attention,mimo"]
    timing = {"mean_us_per_call": 0, "wall_seconds": 0}
    cut = {k: run | timing for k, run in _run(tmp_path, *args).items()}  # the plugin's default
    off = {k: run | timing for k, run in _run(tmp_path, *args, "--step-prefill-floor", "0").items()}
    never = {k: run | timing for k, run in _run(tmp_path, *args, "--step-prefill-floor", "8192").items()}
    for engine in ("mimo", "mimo-stock-attention"):  # window-local SWA attention or not
        assert cut[(engine, 1.5)]["prefill_steps_cut"] > 0 and off[(engine, 1.5)]["prefill_steps_cut"] == 0
        assert cut[(engine, 1.5)]["sim_seconds"] != off[(engine, 1.5)]["sim_seconds"]
    assert cut[("swa-free", 1.5)] == off[("swa-free", 1.5)]  # upstream's manager is never cut
    assert never == off  # a floor of the whole step budget never cuts
    with pytest.raises(SystemExit):
        replay.main([*args, "--step-prefill-floor", "-1"])
    assert "--step-prefill-floor must be >= 0" in capsys.readouterr().err


def test_budget_too_small_for_one_request_says_so(tmp_path, capsys):
    assert replay.main(["--trace", str(DATA / "siblings.jsonl"), "--layout", "mimo-v2.5-pro",
                        "--kv-gib", "0.02", "--quiet"]) == 2
    assert "cannot hold" in capsys.readouterr().err


def test_diagnosis_accounts_for_the_blocks_and_the_pseudo_hits(tmp_path, capsys):
    out = tmp_path / "diagnosis.json"
    args = ["--workload", "agent-sessions", "--layout", "mimo-v2.5-pro", "--kv-gib", "3",
            "--max-requests", "40", "--json", str(out)]
    assert replay_diagnose.main(args) == 0
    diagnosis = json.loads(out.read_text())
    # Every block is somewhere; sampled means of a partition add up to the pool (null block aside).
    assert sum(diagnosis["mean_blocks_by_use"].values()) == pytest.approx(diagnosis["blocks"] - 1, abs=3)
    assert sum(diagnosis["pseudo_hit_tokens_by_cause"].values()) == diagnosis["pseudo_hit_tokens"]
    # Each pseudo hit is told once by where its Full path ends and once by its anchor's fate.
    assert diagnosis["pseudo_hit_tokens"] > 0
    for table in ("pseudo_hit_tokens_by_end", "pseudo_hit_tokens_by_anchor_fate", "pseudo_hit_tokens_by_end_and_fate"):
        assert sum(diagnosis[table].values()) == diagnosis["pseudo_hit_tokens"], table
    assert set(diagnosis["pseudo_hit_tokens_by_end"]) <= {
        "output end", "prompt end", "grid point", "junction off the grid (an earlier prompt went on)", "nowhere of these"
    }
    assert all(
        fate in ("never placed", "anchor there (its window not whole)") or fate.startswith("evicted, ")
        for fate in diagnosis["pseudo_hit_tokens_by_anchor_fate"]
    )
    assert "anchor evictions by trigger" in capsys.readouterr().out


def test_diagnosis_rejects_bad_input(capsys):
    with pytest.raises(SystemExit):
        replay_diagnose.main(["--workload", "mixed", "--layout", "nope", "--kv-gib", "4"])
    assert "known layouts: mimo-v2.5-pro" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replay_diagnose.main(["--workload", "mixed", "--layout", "mimo-v2.5-pro", "--kv-gib", "0"])
    assert "--kv-gib must be > 0, got 0.0" in capsys.readouterr().err


def test_clairvoyance_for_some_kinds_only(tmp_path):
    """eval.replay_bound --oracle-kinds: the clairvoyant engines read the future for the kinds
    named only; the plugin's rule places the other speculative kinds, where no later hit ends too
    (the negative control: without the option none is placed there)."""
    requests = make_workload("shared-system-prompt", seed=0)[:80]
    ideal = replay.ideal_hits(requests)

    def placements(oracle_kinds) -> tuple[list[tuple[AnchorKind, bool]], int]:
        placed: list[tuple[AnchorKind, bool]] = []
        make = replay_bound.plugin_factory(requests, ideal, replay_bound.HitsByKind(), "clairvoyant-placement", oracle_kinds)

        class Recorded(CacheObserver):
            def anchor_placed(self, anchor, kind) -> None:
                placed.append((kind, sight.worth_placing(anchor.node, kind)))

        def recorded(*args, **kwargs):
            nonlocal sight
            manager = make(*args, **kwargs)
            sight = replay_bound.Clairvoyance(requests, ideal)
            sight.manager = manager
            manager.cache.subscribe(Recorded())
            return manager

        sight = None
        run = replay.simulate("mimo", "mimo-v2.5-pro", 1.0, requests, ideal, replay.SimParams(),
                              progress=False, mimo_factory=recorded)
        return placed, run.hit_tokens

    tails = frozenset({AnchorKind.PROMPT_TAIL})
    placed, hits = placements(tails)
    assert all(ok for kind, ok in placed if kind is AnchorKind.PROMPT_TAIL)
    assert any(not ok for kind, ok in placed if kind is not AnchorKind.PROMPT_TAIL and kind in SPECULATIVE_KINDS)
    everywhere, _ = placements(SPECULATIVE_KINDS)
    assert everywhere and all(ok for kind, ok in everywhere if kind in SPECULATIVE_KINDS)

    out = tmp_path / "bound.json"
    assert replay_bound.main(["--workload", "shared-system-prompt", "--layout", "mimo-v2.5-pro", "--kv-gib", "1",
                              "--max-requests", "80", "--quiet", "--engines", "clairvoyant-placement",
                              "--oracle-kinds", "prompt_tail", "--json", str(out)]) == 0
    bound = json.loads(out.read_text())
    assert bound["oracle_kinds"] == ["prompt_tail"]
    assert [(r["engine"], r["hit_tokens"]) for r in bound["runs"]] == [("clairvoyant-placement", hits)]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        (
            "--oracle-kinds",
            "grid,hot",
            "--oracle-kinds must name one or more of grid, output_end, prompt_end, prompt_tail, got 'grid,hot'",
        ),
        ("--oracle-kinds", "", "--oracle-kinds must name one or more of"),
        ("--engines", "mimo,mimo", "--engines must name each of swa-free, mimo, clairvoyant-placement, clairvoyant at most once"),
        ("--engines", "upstream-r0", "--engines must name each of"),
    ],
)
def test_replay_bound_rejects_bad_engines_and_kinds(capsys, flag, value, message):
    with pytest.raises(SystemExit) as e:
        replay_bound.main(["--workload", "mixed", "--layout", "mimo-v2.5-pro", "--kv-gib", "4", flag, value])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_clairvoyant_anchors_sit_only_where_a_later_request_hits(tmp_path):
    """eval.replay_bound: its anchors are at ideal-hit junctions (or resumes), the manager stays
    consistent, and its plugin and swa-free columns are eval.replay's."""
    requests = make_workload("shared-system-prompt", seed=0)[:80]
    ideal = replay.ideal_hits(requests)
    placed: list[bool] = []
    by_kind = replay_bound.HitsByKind()
    make_clairvoyant = replay_bound.plugin_factory(requests, ideal, by_kind, "clairvoyant")

    class Checked(CacheObserver):
        def __init__(self, manager) -> None:
            self.manager = manager

        def anchor_placed(self, anchor, kind) -> None:
            placed.append(kind is AnchorKind.RESUME or self.sight.worth_placing(anchor.node, kind))

        def freed(self, request) -> None:
            self.manager.check_integrity()

    def checked(*args, **kwargs):
        manager = make_clairvoyant(*args, **kwargs)
        observer = Checked(manager)
        observer.sight = replay_bound.Clairvoyance(requests, ideal)
        observer.sight.manager = manager
        manager.cache.subscribe(observer)
        return manager

    run = replay.simulate("mimo", "mimo-v2.5-pro", 1.0, requests, ideal, replay.SimParams(),
                          progress=False, mimo_factory=checked)
    assert placed and all(placed)
    assert 0 < run.hit_tokens <= run.ideal_hit_tokens
    # Every hit token is counted once, at the kind of anchor its hit ends at.
    assert sum(by_kind.tokens.values()) == run.hit_tokens and by_kind.tokens["hot"] > 0

    out = tmp_path / "bound.json"
    args = ["--workload", "shared-system-prompt", "--layout", "mimo-v2.5-pro", "--kv-gib", "1",
            "--max-requests", "80", "--quiet"]
    assert replay_bound.main([*args, "--json", str(out)]) == 0
    bound = {r["engine"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(bound) == set(replay_bound.ENGINES)
    assert bound["clairvoyant"]["hit_tokens"] == run.hit_tokens
    assert bound["clairvoyant"]["hits_by_anchor_kind"] == dict(by_kind.tokens)
    assert "hits_by_anchor_kind" not in bound["swa-free"]
    plain = _run(tmp_path, *args, "--engines", "swa-free,mimo")
    for engine in ("swa-free", "mimo"):
        assert bound[engine]["hit_tokens"] == plain[(engine, 1.0)]["hit_tokens"]


def test_bound_rejects_bad_input(capsys):
    with pytest.raises(SystemExit):
        replay_bound.main(["--workload", "mixed", "--layout", "mimo-v2.5-pro", "--kv-gib", "4", "0"])
    assert "--kv-gib values must be > 0, got [4.0, 0.0]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replay_bound.main(["--workload", "nope", "--layout", "mimo-v2.5-pro", "--kv-gib", "4"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_compare_finds_the_same_counts_or_names_the_difference(tmp_path, capsys):
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    args = ["--trace", str(DATA / "siblings.jsonl"), "--layout", "mimo-v2.5-pro", "--kv-gib", "4", "--quiet",
            "--engines", "upstream-r0,mimo"]
    assert replay.main([*args, "--json", str(before / "replay-siblings.json")]) == 0
    assert replay.main([*args, "--json", str(after / "replay-siblings.json")]) == 0
    assert replay_compare.main([str(before), str(after)]) == 0
    assert "2 runs compared: the same counts" in capsys.readouterr().out
    data = json.loads((after / "replay-siblings.json").read_text())
    data["runs"][1]["hit_tokens"] -= 16
    (after / "replay-siblings.json").write_text(json.dumps(data))
    assert replay_compare.main([str(before), str(after)]) == 1
    assert "replay-siblings.json mimo 4 GiB: {'hit_tokens': (2032, 2016)}" in capsys.readouterr().out
    assert replay_compare.main([str(before), str(after), "--table", "mimo"]) == 0
    out = capsys.readouterr().out
    assert "| replay-siblings | 4 | 2,032 | 2,016 | 0.9921 |" in out
    assert "1 points; lowest hit tokens after ÷ before: 0.9921 (replay-siblings 4 GiB)" in out
    assert replay_compare.main([str(before), str(after), "--table", "mimo", "--min", "0.99"]) == 0
    assert replay_compare.main([str(before), str(after), "--table", "mimo", "--min", "0.995"]) == 1
    assert "below 0.995 at some point: lowest 0.9921" in capsys.readouterr().out
    for bad in (["--min", "0.98"], ["--table", "mimo", "--min", "0"]):
        with pytest.raises(SystemExit):
            replay_compare.main([str(before), str(after), *bad])
        assert "--min needs --table and a ratio > 0" in capsys.readouterr().err
    assert replay_compare.main([str(before), str(after), "--table", "nope"]) == 2
    assert "no nope runs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replay_compare.main([str(before), str(tmp_path / "nowhere")])
    assert "nowhere is not a folder" in capsys.readouterr().err


def test_requests_longer_than_max_model_len_are_skipped_and_counted(tmp_path, capsys):
    trace = tmp_path / "long.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}\n'
        '{"timestamp": 5, "input_length": 2000, "output_length": 10, "hash_ids": [0, 2, 3, 4]}\n'
        '{"timestamp": 9, "input_length": 700, "output_length": 10, "hash_ids": [0, 5]}\n'
    )
    args = ["--trace", str(trace), "--layout", "mimo-v2.5-pro", "--kv-gib", "4", "--engines", "swa-free,mimo"]
    out = tmp_path / "replay.json"
    assert replay.main([*args, "--max-model-len", "1024", "--json", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "skipping 1 of 3 requests: longer than max_model_len 1024" in captured.err
    assert captured.out.splitlines()[0].split()[-2] == "skipped"
    data = json.loads(out.read_text())
    assert data["skipped_too_long"] == 1 and data["params"]["max_model_len"] == 1024
    for run in data["runs"]:
        assert run["requests"] == 2 and run["skipped_too_long"] == 1
        assert run["prompt_tokens"] == 600 + 700 and run["hit_tokens"] == 512  # the third hits the first's block
    # Negative control: with room for all three, nothing is skipped.
    assert replay.main([*args, "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["skipped_too_long"] == 0

    assert replay.main([*args, "--max-model-len", "512"]) == 2
    assert "all 3 requests are longer than max_model_len 512" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replay.main([*args, "--max-model-len", "1000"])
    assert "--max-model-len must be a multiple of 16 and >= 32, got 1000" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["long-conversations", "long-conversations-shared"])
def test_long_conversations_branch_only_on_whole_512_token_blocks(name):
    """Like public Mooncake traces: whatever two prompts share is a run of whole 512-token blocks,
    prompts are 5K to ~33K tokens, and many requests share a prefix with an earlier one."""
    requests = make_workload(name, seed=0, scale=0.1)
    seen: set[tuple] = set()
    shared = 0
    for r in requests:
        assert 5_000 <= r.prompt_len <= 30_000 + 3_000 + 512
        common = 0
        while common < len(r.prompt) and r.prompt[: common + 1] in seen:
            common += 1
        assert all(s.length == 512 for s in r.prompt[:common]), "a shared prefix ends inside a 512-token block"
        shared += common > 0
        seen.update(r.prompt[: i + 1] for i in range(len(r.prompt)))
    assert shared > len(requests) / 2
    assert previous_turns(requests) == [None] * len(requests)  # sent at their timestamps


def test_sensitivity_replays_both_anchor_orders_at_nearby_budgets(tmp_path, capsys):
    out = tmp_path / "sensitivity.json"
    args = ["--workload", "agent-sessions", "--layout", "mimo-v2.5-pro", "--max-requests", "60"]
    assert replay_sensitivity.main([*args, "--kv-gib", "1.5", "--steps", "1", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    (point,) = data["points"]
    assert point["budgets"] == [1.485, 1.5, 1.515]
    runs = {(r["engine"], r["kv_gib"]): r for r in data["runs"]}
    assert len(runs) == 6
    for engine in ("mimo", "mimo-lru"):
        hits = [runs[engine, g]["hit_tokens"] for g in point["budgets"]]
        summary = point["engines"][engine]
        assert summary["hit_tokens"] == pytest.approx(sum(hits) / 3)
        low, high = summary["hit_tokens_spread"]
        assert low == pytest.approx(min(hits) / hits[1]) and high == pytest.approx(max(hits) / hits[1])
    # The two orders really differ here (anchors are evicted): the worth is what `mimo-lru` drops.
    assert any(runs["mimo", g]["hit_tokens"] != runs["mimo-lru", g]["hit_tokens"] for g in point["budgets"])
    assert point["mimo_over_other"]["hit_tokens"] == pytest.approx(
        point["engines"]["mimo"]["hit_tokens"] / point["engines"]["mimo-lru"]["hit_tokens"])
    assert "mimo ÷ mimo-lru" in capsys.readouterr().out
    # Against the plugin on stock attention instead.
    assert replay_sensitivity.main([*args, "--kv-gib", "1.5", "--steps", "1", "--against", "mimo-stock-attention",
                                    "--json", str(out), "--quiet"]) == 0
    (point,) = json.loads(out.read_text())["points"]
    assert set(point["engines"]) == {"mimo", "mimo-stock-attention"} and point["against"] == "mimo-stock-attention"
    assert "mimo ÷ mimo-stock-attention" in capsys.readouterr().out
    for bad, message in ((["--spread", "0"], "--spread must be in (0, 0.5), got 0.0"),
                         (["--steps", "0"], "--steps must be >= 1, got 0")):
        with pytest.raises(SystemExit):
            replay_sensitivity.main([*args, "--kv-gib", "1.5", *bad])
        assert message in capsys.readouterr().err


def test_ttft_split_adds_up_to_the_difference_of_the_means(tmp_path, capsys):
    # The hand-made trace (above): each request runs alone in one step; the plugin hits C's 512
    # tokens that upstream r0 does not, and nothing else differs.
    out = tmp_path / "ttft.json"
    args = ["--trace", str(DATA / "siblings.jsonl"), "--layout", "mimo-v2.5-pro", "--kv-gib", "4", "--quiet"]
    assert replay_ttft.main([*args, "--engines", "mimo,upstream-r0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    split = data["split"]
    assert split["A hits more"] == {"requests": 1, "hit_tokens": 512, "wait_s": 0.0,
                                    "prefill_s": pytest.approx(-512 * 50e-6 / 4), "admitted_later": 0, "admitted_earlier": 0,
                                    "steps_apart": 0}
    assert split["A hits fewer"]["requests"] == 0 and split["hit alike"]["requests"] == 3
    assert split["hit alike"]["wait_s"] == split["hit alike"]["prefill_s"] == 0.0
    assert "| A hits more | 1 | +512 | -6.4000 |" in capsys.readouterr().out
    # Under memory pressure, requests hit alike wait differently too; the rows still add up.
    args = ["--workload", "agent-sessions", "--layout", "mimo-v2.5-pro", "--max-requests", "60", "--kv-gib", "1.5", "--quiet"]
    assert replay_ttft.main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    a, b = data["runs"]
    assert (a["engine"], b["engine"]) == ("mimo", "mimo-stock-attention") and "first_tokens" not in a
    split = data["split"].values()
    assert sum(s["requests"] for s in split) == a["requests"] == b["requests"] == 60
    assert sum(s["hit_tokens"] for s in split) == a["hit_tokens"] - b["hit_tokens"]
    assert sum(s["wait_s"] + s["prefill_s"] for s in split) == pytest.approx(a["ttft_mean_s"] - b["ttft_mean_s"], abs=1e-12)
    assert all(s["steps_apart"] <= s["admitted_later"] + s["admitted_earlier"] <= s["requests"] for s in split)
    assert a["hit_tokens"] != b["hit_tokens"]  # the case is not trivial
    for bad, message in ((["--engines", "mimo"], "--engines must name two different engines"),
                         (["--engines", "mimo,mimo"], "--engines must name two different engines"),
                         (["--engines", "mimo,nope"], "--engines must name two different engines"),
                         (["--kv-gib", "0"], "--kv-gib must be > 0, got 0.0")):
        with pytest.raises(SystemExit):
            replay_ttft.main(["--workload", "mixed", "--layout", "mimo-v2.5-pro", "--kv-gib", "4", *bad])
        assert message in capsys.readouterr().err


def test_host_tier_engines_extend_hits_from_host_memory(tmp_path, capsys):
    """With a host tier 4x the device: the plugin's (mask-only) hits more than without one, and
    stores at most a window of SWA KV per anchor; storing SWA tails whole fills the host with
    SWA KV; vLLM's OffloadingConnector, driven for real, loads from host too."""
    runs = _run(tmp_path, "--workload", "agent-sessions", "--layout", "mimo-v2.5-pro", "--kv-gib", "1.5",
                "--max-requests", "60", "--engines", "mimo,mimo-host,mimo-host-dense,upstream-offload")
    mimo, host, dense, offload = (runs[(e, 1.5)] for e in ("mimo", "mimo-host", "mimo-host-dense", "upstream-offload"))
    assert host["host_gib"] == dense["host_gib"] == offload["host_gib"] == 6.0 and mimo["host_gib"] == 0
    assert host["hit_tokens"] > mimo["hit_tokens"] and 0 < host["host_hit_tokens"] < host["hit_tokens"]
    assert host["host_bytes_loaded"] > 0 and host["bytes_loaded_per_restored_token"] > 0
    assert 0 < host["host_swa_tokens_per_anchor"] <= 128 < dense["host_swa_tokens_per_anchor"]  # W = 128
    assert offload["host_hit_tokens"] > 0 and offload["host_bytes_stored"] > 0
    assert mimo["host_bytes_stored"] == mimo["host_hit_tokens"] == 0
    for run in runs.values():
        assert run["hit_tokens"] <= run["ideal_hit_tokens"]
    for bad, message in ((["--host-gib", "0"], "--host-gib must be > 0"), (["--host-gbps", "-1"], "--host-gbps must be > 0")):
        with pytest.raises(SystemExit):
            replay.main(["--workload", "mixed", "--layout", "mimo-v2.5-pro", "--kv-gib", "1", *bad])
        assert message in capsys.readouterr().err


@pytest.mark.slow  # two revisions' replays, one after the other on one CPU: tens of seconds
def test_manager_time_of_two_revisions_at_once_on_one_cpu(tmp_path, capsys):
    """HEAD exported by git against the working tree, both pinned to one CPU: µs per call of
    each, its ratio to the first, and which have the same counts, per budget."""
    out = tmp_path / "us.json"
    args = ["--workload", "shared-system-prompt", "--layout", "mimo-v2.5-pro", "--max-requests", "12", "--kv-gib", "2"]
    assert replay_us.main(["--rev", "HEAD", "--rev", ".", "--json", str(out), "--", *args]) == 0
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["revisions"]] == ["HEAD", "."] and data["gc"] is True
    (point,) = data["points"]
    assert point["engine"] == "mimo" and point["kv_gib"] == 2
    assert point["ratio_to_first"]["HEAD"] == 1.0 and point["ratio_to_first"]["."] > 0
    assert point["us_per_call"]["."] > 0 and point["hit_tokens"]["HEAD"] > 0
    assert point["same_counts"] in ([["HEAD", "."]], [])  # the same unless the tree changed the policy
    assert "| mimo | 2 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rev", "HEAD", "--", "--workload", "mixed"], "give two revisions or more to compare, got 1"),
        (["--rev", "HEAD", "--rev", "HEAD", "--", "--workload", "mixed"], "give each revision once, got HEAD HEAD"),
        (["--rev", "no-such-rev", "--rev", ".", "--", "--workload", "mixed"], "--rev 'no-such-rev' is not a commit"),
        (["--rev", "HEAD", "--rev", ".", "--cpu", "4096", "--", "--workload", "mixed"], "--cpu must be one of"),
        (["--rev", "HEAD", "--rev", "."], "give the replay's arguments after `--`"),
        (["--rev", "HEAD", "--rev", ".", "--", "--workload", "mixed", "--engines", "mimo"], "are set by this tool"),
    ],
)
def test_manager_time_tool_rejects_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        replay_us.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_stretched_arrivals_and_the_queue_lookahead(tmp_path, capsys):
    """--stretch K sends every request at K times its timestamp (a cluster's trace at one
    engine's load: shorter queues, a longer run, the same requests); --queue-lookahead 0 turns
    the plugin's look-ahead off; bad values of either are refused with the accepted range."""
    args = ["--trace", "eval/traces/agentic-mooncake.jsonl", "--layout", "mimo-v2.5-pro", "--kv-gib", "4",
            "--max-requests", "120", "--engines", "swa-free,mimo"]
    recorded, stretched = _run(tmp_path, *args), _run(tmp_path, *args, "--stretch", "8")
    for engine in ("swa-free", "mimo"):
        assert stretched[(engine, 4.0)]["ttft_mean_s"] < recorded[(engine, 4.0)]["ttft_mean_s"]
        assert stretched[(engine, 4.0)]["sim_seconds"] > recorded[(engine, 4.0)]["sim_seconds"]
        assert stretched[(engine, 4.0)]["ideal_hit_tokens"] == recorded[(engine, 4.0)]["ideal_hit_tokens"]
    off = _run(tmp_path, *args, "--queue-lookahead", "0")
    assert off[("swa-free", 4.0)] | {"mean_us_per_call": 0, "wall_seconds": 0} == recorded[("swa-free", 4.0)] | {
        "mean_us_per_call": 0, "wall_seconds": 0}  # upstream's engines have no look-ahead
    for bad, message in ((["--stretch", "0"], "--stretch must be > 0, got 0.0"),
                         (["--queue-lookahead", "-1"], "--queue-lookahead must be >= 0 requests (0: off), got -1")):
        with pytest.raises(SystemExit):
            replay.main([*args, *bad])
        assert message in capsys.readouterr().err


def test_hits_by_where_the_ideal_hit_ends(tmp_path, capsys):
    from eval.replay_ends import hit_ends
    from eval.workloads import read_mooncake

    lines = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 9], [1, 2, 3, 4], [7]]
    trace = tmp_path / "ends.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(h) - 100, "output_length": 4,
                                         "hash_ids": h}) + "\n" for i, h in enumerate(lines)))
    assert hit_ends(read_mooncake(str(trace))) == ["none", "mid-prompt", "tail", "whole prompt", "none"]
    # The hand-made trace (above): B resends A, C and D go on from A's first block (A's tail).
    out = tmp_path / "ends.json"
    args = ["--trace", str(DATA / "siblings.jsonl"), "--layout", "mimo-v2.5-pro", "--kv-gib", "4", "--quiet"]
    assert replay_ends.main([*args, "--engines", "mimo,upstream-r0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows["whole prompt"] == {"requests": 1, "ideal": 1008, "mimo": 1008, "upstream-r0": 1008}
    assert rows["tail"] == {"requests": 2, "ideal": 1024, "mimo": 1024, "upstream-r0": 512}
    assert rows["mid-prompt"]["requests"] == 0 and rows["none"]["requests"] == 1
    assert "| tail | 2 | 1,024 | 1,024 (1.00) | 512 (0.50) |" in capsys.readouterr().out
    for bad, message in ((["--engines", "mimo,mimo"], "--engines names an engine twice"),
                         (["--engines", "nope"], "unknown engine(s) ['nope']"),
                         (["--kv-gib", "0"], "--kv-gib must be > 0, got 0.0")):
        with pytest.raises(SystemExit):
            replay_ends.main([*args, *bad])
        assert message in capsys.readouterr().err


def test_the_replay_and_its_diagnosis_set_the_plugins_chunk_points(tmp_path, capsys):
    out = tmp_path / "chunk.json"
    args = ["--trace", str(DATA / "siblings.jsonl"), "--layout", "mimo-v2.5-pro", "--kv-gib", "4", "--engines", "mimo"]
    assert replay.main([*args, "--chunk-anchor-tokens", "1024", "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["params"]["chunk_anchor_tokens"] == 1024
    diagnosed = tmp_path / "diagnosis.json"
    assert replay_diagnose.main([*args[:-2], "--chunk-anchor-tokens", "1024", "--json", str(diagnosed)]) == 0
    assert json.loads(diagnosed.read_text())["chunk_anchor_tokens"] == 1024
    for tool, tool_args in ((replay, args), (replay_diagnose, args[:-2])):
        for bad, message in (("1000", "must be a multiple of grid_anchor_tokens=512"), ("-512", "out of range")):
            with pytest.raises(SystemExit):
                tool.main([*tool_args, "--chunk-anchor-tokens", bad])
            assert message in capsys.readouterr().err
