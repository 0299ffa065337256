"""The tiny MiMo's corpus: the installed interpreter's standard-library sources, split by file
into train and held-out sets with a fixed seed (`corpus_split`), and a token stream of files
(`encode_files`). Shared by the training (`eval.train_tiny`), the copy task, the MTP bench and
the lm-eval data."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

SPLIT_SEED = 20240605
HELDOUT_FRACTION = 0.1


def corpus_split(seed: int = SPLIT_SEED, heldout_fraction: float = HELDOUT_FRACTION) -> tuple[list[Path], list[Path]]:
    """(train, held-out) standard-library files: a seeded shuffle of the sorted list, split by file.

    The train list keeps the shuffled order (the tokenizer reads it in that order); the held-out
    list is sorted.
    """
    from vllm_mimo.testing.tiny_model import stdlib_text_files

    files = stdlib_text_files()
    shuffled = list(files)
    random.Random(seed).shuffle(shuffled)
    n_held = max(1, round(len(files) * heldout_fraction))
    return shuffled[n_held:], sorted(shuffled[:n_held])


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def encode_files(tok, files: list[Path], separator_id: int):
    """One token stream: each file's ids followed by `separator_id` (<|endoftext|>)."""
    import torch

    ids: list[int] = []
    for enc in tok.encode_batch([read_text(p) for p in files]):
        ids.extend(enc.ids)
        ids.append(separator_id)
    return torch.tensor(ids, dtype=torch.int32)
