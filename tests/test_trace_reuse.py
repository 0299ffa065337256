"""eval.trace_reuse: when a later request goes on from a prompt, by prompt length."""

from __future__ import annotations

import json

import pytest

from eval.trace_reuse import bands_of, cached_shares, main, next_use_seconds
from eval.workloads import read_mooncake


def _trace(tmp_path, lines: list[dict]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


LINES = [
    {"timestamp": 0, "input_length": 1400, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 2000, "input_length": 2000, "output_length": 10, "hash_ids": [1, 2, 5, 6]},  # goes on from the first
    {"timestamp": 3000, "input_length": 300, "output_length": 10, "hash_ids": [7]},  # one segment: nothing to go on from
    {"timestamp": 5000, "input_length": 900, "output_length": 10, "hash_ids": [1, 9]},  # not from the first: only one block
    {
        "timestamp": 9000,
        "input_length": 1400,
        "output_length": 10,
        "hash_ids": [1, 2, 8],
    },  # from the first (counted once) and the fourth
]


def test_a_later_request_goes_on_from_all_of_a_prompt_but_its_last_block(tmp_path):
    requests = read_mooncake(_trace(tmp_path, LINES))
    assert next_use_seconds(requests) == [2.0, None, None, 4.0, None]
    small, large = bands_of(requests, (1000,))
    assert (small.requests, small.continued, large.requests, large.continued) == (2, 1, 3, 1)
    assert large.share == pytest.approx(1 / 3) and large.seconds_median == 2.0
    assert small.seconds_median == 4.0 and small.label == "0-1,000" and large.label == ">= 1,000"


def test_bands_by_the_share_of_the_prompt_cached_on_arrival(tmp_path, capsys):
    requests = read_mooncake(_trace(tmp_path, LINES))
    assert cached_shares(requests) == [0.0, 0.5, 0.0, 0.5, 2 / 3]
    none, under, half = bands_of(requests, (), by_cached=True)
    assert (none.requests, none.continued, under.requests, half.requests, half.continued) == (2, 1, 0, 3, 1)
    assert half.label == "half or more"
    out = tmp_path / "reuse.json"
    assert main(["--trace", _trace(tmp_path, LINES), "--by", "cached", "--json", str(out)]) == 0
    assert [b["label"] for b in json.loads(out.read_text())["bands"]] == ["none", "under half", "half or more"]
    assert "| half or more | 3 | 1 | 0.33 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--trace", _trace(tmp_path, LINES), "--by", "cached", "--bands", "1000"])
    assert "--bands applies to --by length only" in capsys.readouterr().err


def test_the_command_writes_the_table_and_rejects_bad_bands(tmp_path, capsys):
    out = tmp_path / "reuse.json"
    assert main(["--trace", _trace(tmp_path, LINES), "--bands", "1000", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["requests"] == 5 and [b["continued"] for b in data["bands"]] == [1, 1]
    assert "| >= 1,000 | 3 | 1 | 0.33 |" in capsys.readouterr().out
    for bad in ("3000,2000", "0,10", "a,b"):
        with pytest.raises(SystemExit):
            main(["--trace", _trace(tmp_path, LINES), "--bands", bad])
        assert "--bands must be" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}\n')
    assert main(["--trace", str(tmp_path / "bad.jsonl")]) == 1
    assert "missing field 'input_length'" in capsys.readouterr().err
