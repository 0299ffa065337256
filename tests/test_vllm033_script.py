"""eval/vllm033.sh (make check-vllm033 / test-vllm033): a bad lane is refused before anything is
installed."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_an_unknown_lane_is_refused_with_the_usage_and_installs_nothing(tmp_path):
    target = tmp_path / "overlay"
    run = subprocess.run(
        ["bash", str(ROOT / "eval" / "vllm033.sh"), "bogus"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "VLLM033_DIR": str(target)},
    )
    assert run.returncode == 2
    assert "usage:" in run.stderr and "check|test" in run.stderr
    assert not target.exists()
