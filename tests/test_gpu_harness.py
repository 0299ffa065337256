"""The GPU checks' CPU dry runs (`eval/gpu_vllm_harness.py`, `eval/gpu_check.py`) and what the
device run carries (`eval/gpu_wheels.sh`): what runs here of what a lent GPU runs, so the device
run has its best chance to work first time.

Slow lane (each in its own process: the dry runs put a stand-in `flashinfer` in sys.modules).
The harness drives the plugin's CUDA builders and impls through vLLM's own FlashInfer (and, for
different K/V head sizes, FlashAttention DIFFKV) classes and config (the kernels stood in for by
torch), on mixed decode + prefill steps over caches with garbage outside the windows, both cache
layouts; it passes only with its
negative control moving the output past the tolerance. The sink case is refused by vLLM's own
builder where FlashInfer cannot serve sinks (what `configure` refuses at startup). The device
script's dry run checks exactness with its negative control, host syncs, its timing rows and
the host tier's copies. Fast lane: the FlashInfer wheel the device run carries keeps the sources
it builds (cascade among them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_vllm_harness_dry_run_matches_stock_and_reference(tmp_path):
    out = tmp_path / "harness.json"
    run = subprocess.run([sys.executable, "-m", "eval.gpu_vllm_harness", "--json", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    ran = [row for row in rows if "refused_by_vllm" not in row]
    assert {row["layout"] for row in ran} == {"NHD", "HND"} and report["dry_run"] and report["stand_ins"]
    assert all(row["max_error_ours"] <= report["tolerance"] < row["negative_control_error"] for row in ran)
    assert all(row["decodes"] and row["prefills"] and row["null_blocks_in_ours"] for row in ran)
    # The step's SWA groups share one kernel, planned at most once for all of them.
    flashinfer = [row for row in ran if row["case"]["backend"] == "flashinfer"]
    assert all(row["groups"] == 2 and row["kernels_for_the_groups"] == 1 and row["kernel_plans_this_step"] <= 1
               for row in flashinfer)
    # MiMo's K/V head sizes: the plugin's DIFFKV builder and impl against vLLM's FlashAttention ones.
    assert [row["case"]["backend"] for row in ran if row not in flashinfer] == ["diffkv"]
    refused = [row for row in rows if "refused_by_vllm" in row]
    assert refused and all(row["case"]["sinks"] and row["sink_support"] is None for row in refused)
    assert any(row["case"]["sinks"] for row in ran)  # as on SM90 with trtllm-gen's cubins


@pytest.mark.slow
def test_gpu_check_dry_run_passes_its_checks(tmp_path):
    """`eval/gpu_check.py --dry-run`: the device script's code on CPU (tiny shapes, FlashInfer
    stood in for): exact against the reference with its negative control moving, no host sync in
    the layers, every timing row made, the JSON the results page reads."""
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, "-m", "eval.gpu_check", "--dry-run", "--repeat", "1", "--shape", "gpt-oss-like",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and [row["passed"] for row in report["exactness"]] == [True]
    row = report["exactness"][0]
    assert row["max_error_ours"] <= report["tolerance"] < row["negative_control_error"] and row["host_syncs"] == "none"
    assert len(report["timing"]) == 6 and all("error" not in row for row in report["timing"])
    assert report["host_copy"]["passed"]  # the host tier's copy path, byte-exact, on CPU
    # The results page's "On a GPU" section renders such a JSON (the device run's has its schema).
    import shutil

    from eval import results_page

    for name in ("gpu-check.json", "gpu-vllm-harness-cpu.json"):
        shutil.copy(Path(__file__).resolve().parent.parent / results_page.RESULTS / name, tmp_path / name)
    out.rename(tmp_path / "gpu-check-scratch.json")
    section = "\n".join(results_page.gpu_section(tmp_path).lines)
    assert "**The one-call path on a GPU**: one cpu (dry run)" in section and "| gpt-oss-like | " in section


def test_gpu_wheels_keeps_the_sources_the_check_builds():
    """`eval/gpu_wheels.sh` repacks FlashInfer without the CUDA sources the GPU check never
    builds: it keeps the prefill (fa2 and sm90), decode and cascade (merge) ones and drops the rest."""
    import re

    script = (Path(__file__).resolve().parent.parent / "eval" / "gpu_wheels.sh").read_text()
    keep = re.compile(re.search(r'keep_csrc = re\.compile\(r"(.+)"\)', script).group(1))
    csrc = "flashinfer/data/csrc/"
    for kept in ("cascade.cu", "flashinfer_cascade_binding.cu", "batch_prefill_sm90.cu", "batch_prefill_paged.cu",
                 "batch_decode.cu", "pytorch_extension_utils.h"):
        assert keep.match(csrc + kept), kept
    for dropped in ("fused_moe/moe_kernel.cu", "gemm_groupwise_sm100.cu", "sampling.cu"):
        assert not keep.match(csrc + dropped), dropped
