"""`eval/bench_serve.py` (what `make demo` runs): bad arguments, and a short run to the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eval import bench_serve

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize(
    "flag,value,allowed",
    [("--kv-gib", "0", "> 0"), ("--clients", "0", ">= 1"), ("--duration", "-1", "> 0"),
     ("--sessions", "0", ">= 1"), ("--block-size", "24", "a positive multiple of 16"), ("--host-gib", "-1", ">= 0")],
)
def test_out_of_range_arguments_name_the_value_and_the_range(flag, value, allowed, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_serve.main(["--workload", "shared-system-prompt", flag, value])
    assert exit_info.value.code == 2
    assert (
        f"{flag} {float(value) if flag in ('--kv-gib', '--duration', '--host-gib') else value} is out of range; "
        f"allowed: {allowed}"
        in capsys.readouterr().err
    )


@pytest.mark.engine
def test_a_short_run_prints_the_table_and_writes_the_json_with_every_answer_the_same(tmp_path):
    """In float32 (twice the KV bytes of the default bf16 run) a cached prefix and a computed
    one give the same greedy answers, so every turn answers the same with the plugin on and
    off; in bf16 some do not, with or without the plugin (eval/RESULTS.md, issue 4)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "eval.bench_serve", "--workload", "shared-system-prompt", "--sessions", "2",
         "--duration", "30", "--dtype", "float32", "--kv-gib", "0.03", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prompt tokens computed" in proc.stdout and "same answer, plugin off and plugin on" in proc.stdout
    data = json.loads(out.read_text())
    for side in ("on", "off"):
        for key in ("prompt_tokens_computed", "hit_tokens", "pseudo_hit_tokens", "ttft_p50_s", "ttft_p90_s",
                    "output_tokens_per_s"):
            assert key in data[side]
        assert data[side]["requests"] > 0
    assert data["off"]["pseudo_hit_tokens"] is None and data["on"]["pseudo_hit_tokens"] is not None
    assert set(data["ratios"]) >= {"prompt_tokens_computed", "ttft_p50"}
    assert data["turns_compared"] > 0 and data["same_answers"] == data["turns_compared"], data


def test_a_server_that_fails_to_start_names_the_root_cause(tmp_path):
    from vllm_mimo.testing.server import VllmServer

    log = tmp_path / "serve.log"
    log.write_text(
        "(APIServer pid=1) WARNING [system_utils.py:255] ... like `OSError: [Errno 24] Too many open files`.\n"
        "(EngineCore pid=2) ERROR 11-29 17:41:30 [core.py:1510] ValueError: To serve at least one request ...\n"
        "ValueError: To serve at least one request ...\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    server = VllmServer("unused-model", log_path=log)
    assert server.root_cause() == "ValueError: To serve at least one request ..."
