"""Token-id prompts for the exactness tests, cut from standard-library text."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path


def corpus_ids(model_dir: Path, n_tokens: int) -> list[int]:
    """The first `n_tokens` token ids of some standard-library source, in the model's tokenizer."""
    import argparse
    import json

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    text = "".join(inspect.getsource(m) for m in (textwrap, argparse, json.decoder))
    ids = tok.encode(text).ids
    if len(ids) < n_tokens:
        raise ValueError(f"corpus has only {len(ids)} tokens, {n_tokens} asked")
    return ids[:n_tokens]


def exactness_batches(model_dir: Path, window: int = 128) -> list[list[list[int]]]:
    """Two `generate` batches (see tests/test_engine_plugin.py for what each prompt is for).

    Batch 1: 4 prompts sharing a 3-window prefix, 2 prompts longer than 4 windows, 2 short ones.
    Batch 2: the first prompt again (a prefix-cache hit) and a fresh sibling of the shared prefix.
    """
    ids = corpus_ids(model_dir, 6000)
    shared = ids[:3 * window]
    siblings = [shared + ids[1000 + 97 * k : 1000 + 97 * k + 40 + 50 * k] for k in range(4)]
    long_prompts = [ids[2000 : 2000 + 4 * window + 90], ids[3000 : 3000 + 7 * window + 5]]
    short_prompts = [ids[4500:4520], ids[4600 : 4600 + window + 3]]
    fresh_sibling = shared + ids[5000:5077]
    return [siblings + long_prompts + short_prompts, [siblings[0], fresh_sibling]]
