"""Loaders for the local lm-eval tasks: read the committed JSONL files next to this file (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).with_name("data")


def _load(name: str):
    import datasets

    rows = [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def next_line_gen(**kwargs):
    """Documents of `mimo_next_line_gen`: {id, file, line, context, target}."""
    return _load("next_line_gen.jsonl")


def next_line_choice(**kwargs):
    """Documents of `mimo_next_line_choice`: {id, file, line, context, choices, label}."""
    return _load("next_line_choice.jsonl")
