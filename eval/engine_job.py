"""Run one vLLM engine job in a fresh subprocess (`python -m MODULE --engine-job`), in-process
engine mode, and read back its `RESULT {...}` line: the benchmarks' way to start each engine
clean and still reach its internals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_engine_job(module: str, job: dict, env: dict[str, str] | None = None, timeout_s: int = 3600) -> dict:
    """`python -m <module> --engine-job` with `job` as JSON on stdin and `env` added; its
    result, or a RuntimeError with the end of its output."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--engine-job"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})},
        cwd=Path(__file__).resolve().parent.parent,
    )
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not result:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise RuntimeError(f"vLLM run failed (exit {proc.returncode}):\n{tail}")
    return json.loads(result[-1][len("RESULT ") :])
