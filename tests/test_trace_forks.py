"""eval.trace_forks: where later prompts fork mid-prompt, by depth."""

from __future__ import annotations

import json

import pytest

from eval.trace_forks import fork_bands, main
from eval.workloads import read_mooncake

LINES = [
    {"timestamp": 0, "input_length": 1800, "output_length": 10, "hash_ids": [1, 2, 3, 4]},  # mid-prompt: [1], [1, 2]
    {"timestamp": 2000, "input_length": 1400, "output_length": 10, "hash_ids": [1, 2, 5]},  # forks at [1, 2], passes [1]
    {"timestamp": 5000, "input_length": 900, "output_length": 10, "hash_ids": [1, 6]},  # forks at [1], passed before
    {"timestamp": 6000, "input_length": 1800, "output_length": 10, "hash_ids": [1, 2, 7, 8]},  # at [1, 2] again
]


def _trace(tmp_path) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return str(path)


def test_forks_are_counted_per_point_by_depth(tmp_path):
    shallow, deep = fork_bands(read_mooncake(_trace(tmp_path)), (1000,))
    assert (shallow.points, shallow.forked, shallow.fork_tokens, shallow.passed_first) == (1, 1, 512, 1)
    assert (deep.points, deep.forked, deep.fork_tokens, deep.passed_first) == (1, 1, 2048, 0)
    assert shallow.quartiles() == (5.0, 5.0, 5.0) and deep.quartiles() == (2.0, 2.0, 2.0)
    assert deep.share == 1.0 and deep.label == ">= 1,000"
    # Negative control: a prompt tail's place (before the last segment) is not a mid-prompt point.
    assert sum(b.points for b in fork_bands(read_mooncake(_trace(tmp_path))[:1], (1000,))) == 2


def test_the_command_writes_the_table_and_rejects_bad_bands(tmp_path, capsys):
    out = tmp_path / "forks.json"
    assert main(["--trace", _trace(tmp_path), "--bands", "1000", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [b["label"] for b in data["bands"]] == ["0-1,000", ">= 1,000"]
    assert data["bands"][1]["seconds_median"] == 2.0 and data["bands"][1]["fork_tokens"] == 2048
    assert "| >= 1,000 | 1 | 1 | 1.0000 | 2,048 | 0 | 2.0 | 2.0 | 2.0 |" in capsys.readouterr().out
    for bad in ("0,10", "10,5", "x"):
        with pytest.raises(SystemExit):
            main(["--trace", _trace(tmp_path), "--bands", bad])
        assert "--bands must be" in capsys.readouterr().err
