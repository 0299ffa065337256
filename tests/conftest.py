"""Shared fixtures: the tiny model folders and a helper that runs one vLLM engine in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_mimo.testing.tiny_model import make_tiny_model

RUNNER = Path(__file__).with_name("llm_runner.py")
# Small, fixed KV budget and eager mode: engine start takes ~25 s on 2 cores instead of ~90 s.
# In one process (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0) unless a test asks for vLLM's default
# three (front end, engine core, worker): the engine core and worker each import vLLM again, which
# took a run from 27 s to 59 s here.
BASE_LLM_KWARGS = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 256 << 20,
    "max_model_len": 2048,
    "enable_prefix_caching": True,
}


def pytest_configure(config) -> None:
    """Under `make test`'s two test processes (pytest-xdist), each process's engines get a core of
    their own and one OpenMP thread: two engines spinning on the same cores ran 2-3x slower
    each. vLLM's own binding for its worker process (`VLLM_CPU_OMP_THREADS_BIND`), OpenMP's for
    engines in one process. Set any of them to choose otherwise."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    core = str(int(worker.removeprefix("gw")) % (os.cpu_count() or 1))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", core)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GOMP_CPU_AFFINITY", core)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {layout: make_tiny_model(root / layout, layout) for layout in ("mimo", "mimo-flash", "gemma3", "llama")}


@dataclass
class EngineRun:
    batches: list[list[dict]]
    workers: list[dict]
    log: str
    turns: list[list[dict]]
    mimo: dict | None
    preemptions: float | None
    script: dict | None = None

    def ids(self) -> list[list[list[int]]]:
        return [[o["ids"] for o in batch] for batch in self.batches if isinstance(batch, list)]

    def log_lines(self, needle: str) -> list[str]:
        return [line for line in self.log.splitlines() if needle in line]


def run_engine(
    model: Path,
    batches: list[list] | None = None,
    *,
    env: dict[str, str] | None = None,
    llm_kwargs: dict | None = None,
    max_tokens: int = 16,
    sessions: dict | None = None,
    script: list[dict] | None = None,
    record_block_ids: bool = False,
    expect_failure: bool = False,
    patch: str | None = None,
    multiprocess: bool = False,
) -> EngineRun | str:
    """Run `LLM(model)` in a fresh process (see tests/llm_runner.py for the job's fields), its
    engine core and worker in that process too unless `multiprocess` (vLLM's default layout).

    With `expect_failure`, the engine must fail to start; returns its log.
    """
    assert not (patch and multiprocess), "a patch reaches the engine only in one process"
    job = {
        "model": str(model),
        "llm_kwargs": {**BASE_LLM_KWARGS, **(llm_kwargs or {})},
        "max_tokens": max_tokens,
        "batches": batches or [],
        "record_block_ids": record_block_ids,
        "patch": patch,
    }
    if sessions is not None:
        job["sessions"] = sessions
    if script is not None:
        job["script"] = script
    proc = subprocess.run(
        [sys.executable, str(RUNNER)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=900,
        env={
            **os.environ,
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
            **(env or {}),
        },
    )
    log = proc.stdout + proc.stderr
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if expect_failure:
        assert proc.returncode != 0 and not result, "the engine started, but should have failed"
        return log
    # vllm-cpu sometimes aborts at interpreter exit after a clean shutdown (SIGABRT, after the
    # RESULT line): the run's results stand.
    if not result or (proc.returncode != 0 and proc.returncode != -6):
        tail = "\n".join(log.splitlines()[-60:])
        raise AssertionError(f"engine run failed (exit {proc.returncode}):\n{tail}")
    data = json.loads(result[-1][len("RESULT ") :])
    return EngineRun(data["batches"], data["workers"], log, data["turns"], data["mimo"], data["preemptions"], data.get("script"))


def six_user_sessions(ids: list[int]) -> dict:
    """Six users, one 300-token system prompt, three turns each (a `run_engine` sessions job)."""
    return {
        "system": ids[:300],
        "turns": [[ids[1000 + 400 * t + 60 * u : 1000 + 400 * t + 60 * u + 40 + 10 * u] for u in range(6)] for t in range(3)],
    }


# The six users' sessions in a KV cache small enough to preempt (144 blocks of the tiny MiMo).
SIX_USER_KWARGS = {"dtype": "float32", "kv_cache_memory_bytes": 144 * 65536, "max_model_len": 1024, "disable_log_stats": False}


@pytest.fixture(scope="session")
def six_user_runs(tiny_models):
    """`runs(name, env=..., llm_kwargs=..., patch=...)`: the six users' sessions on the tiny MiMo
    (100 output tokens per turn), run once per name for the whole suite (the plugin-off run is
    every module's reference)."""
    from tests.prompts import corpus_ids

    done: dict[str, EngineRun] = {}

    def runs(name: str, *, env: dict | None = None, llm_kwargs: dict | None = None, patch: str | None = None) -> EngineRun:
        if name not in done:
            job = six_user_sessions(corpus_ids(tiny_models["mimo"], 6000))
            done[name] = run_engine(
                tiny_models["mimo"], sessions=job, env=env, max_tokens=100,
                llm_kwargs={**SIX_USER_KWARGS, **(llm_kwargs or {})}, patch=patch,
            )
        return done[name]

    return runs
