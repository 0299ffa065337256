"""A tool-call task whose answers copy high-entropy spans from the prompt (the MTP drafter's test).

    python -m eval.copy_task [--model checkpoints/tiny-mimo-copy] [--count 4] [--kind near]

An agent turn in ChatML (the checkpoint's template): a system line, a user message of code
(standard-library text), a tool result listing K files (a path with hex digits and an 8-hex-digit
id each), then the assistant's answer, which opens each file in turn:
`open("<path>", id="<id>")`, one line per file, copying both spans. K = 1..6 gives answers of
about 25 to 170 tokens (the output-length buckets 0-32, 32-128 and 128-256).

- `near`: the tool result ends the prompt, so the spans sit in its last ~25*K tokens: an MTP
  layer (SWA, window W = 128) that ran over the prompt sees them at the answer's start.
- `far`: the same records, then a user message of at least W + 16 tokens of code before the
  answer: every span sits more than W tokens before the prompt's end, where only the main
  model's full-attention layer reaches; the MTP layers cannot see them, warm or cold.

Spans and structure are tokenized piece by piece and concatenated, so the answer's spans are the
prompt's tokens exactly. `Episode` keeps where the prompt ends; `training_sequence` puts an
episode at the end of a `seq_len` window of code (the fine-tune's copy batches, `eval.train_tiny
--copy-fraction`); `episodes` makes the held-out ones (other files, other seeds) the MTP
oracle and the engine runs use. Printing a few shows what they look like.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

KINDS = ("near", "far")
MAX_RECORDS = 6
WINDOW = 128
FAR_GAP = WINDOW + 16
"""Tokens of code between the tool result and the answer in a `far` episode, at least."""
WORDS = ("build", "cache", "parse", "index", "model", "shard", "route", "event", "store", "batch",
         "token", "queue", "chunk", "table", "layer", "serve")


@dataclass(frozen=True)
class Episode:
    """One agent turn: `ids` = prompt + answer; the prompt is `ids[:prompt_len]`."""

    ids: list[int]
    prompt_len: int
    kind: str
    records: int

    @property
    def answer_len(self) -> int:
        return len(self.ids) - self.prompt_len


class CopyTask:
    """Episodes in one tokenizer (a `tokenizers.Tokenizer` with the ChatML specials)."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self._cache: dict[str, list[int]] = {}

    def _enc(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.tok.encode(text).ids
        return self._cache[text]

    def _span(self, text: str) -> list[int]:
        return self.tok.encode(text).ids  # high-entropy: not worth caching

    def _message(self, role: str, body: list[int]) -> list[int]:
        return self._enc(f"<|im_start|>{role}\n") + body + self._enc("<|im_end|>\n")

    def records(self, rng: random.Random, count: int) -> list[tuple[list[int], list[int]]]:
        """`count` files: (path tokens, id tokens), random hex digits in both."""
        if not 1 <= count <= MAX_RECORDS:
            raise ValueError(f"records={count}: must be 1..{MAX_RECORDS}")
        return [
            (self._span(f"/{rng.choice(WORDS)}/{rng.choice(WORDS)}_{rng.getrandbits(16):04x}.py"),
             self._span(f"{rng.getrandbits(32):08x}"))
            for _ in range(count)
        ]

    def episode(self, files: list[tuple[list[int], list[int]]], code: list[int], gap: list[int], kind: str) -> Episode:
        """An episode over `files` (`records`): the user's code message is `code`, a far episode's
        second user message is `gap` (FAR_GAP tokens of code or more)."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: must be one of {KINDS}")
        if kind == "far" and len(gap) < FAR_GAP:
            raise ValueError(f"a far episode needs a gap of >= {FAR_GAP} tokens, got {len(gap)}")
        listing: list[int] = []
        for path, fid in files:
            listing += self._enc("- ") + path + self._enc(" id=") + fid + self._enc("\n")
        prompt = self._message("system", self._enc("You are a coding agent. Open the files the tool lists."))
        prompt += self._message("user", code)
        prompt += self._message("tool", listing)
        if kind == "far":
            prompt += self._message("user", gap)
        prompt += self._enc("<|im_start|>assistant\n")
        answer: list[int] = []
        for path, fid in files:
            answer += self._enc('open("') + path + self._enc('", id="') + fid + self._enc('")\n')
        answer += self._enc("<|im_end|>")
        return Episode(prompt + answer, len(prompt), kind, len(files))

    def fitted(self, rng: random.Random, stream, length: int, kind: str, count: int) -> Episode:
        """An episode of exactly `length` tokens (or shorter when its files alone do not fit),
        its code messages cut from `stream` (1-D token tensor) at a random offset."""
        files = self.records(rng, count)
        start = rng.randrange(len(stream) - 2 * length - FAR_GAP - 64)
        gap = stream[start + length : start + length + FAR_GAP + rng.randrange(48)].tolist()
        bare = self.episode(files, [], gap, kind)
        code = stream[start : start + max(0, length - len(bare.ids))].tolist()
        return self.episode(files, code, gap, kind)

    def training_sequence(self, rng: random.Random, stream, seq_len: int) -> list[int]:
        """`seq_len` tokens for the fine-tune: one episode (near or far, 1..MAX_RECORDS files)
        whose user message of code takes the room left."""
        ep = self.fitted(rng, stream, seq_len, rng.choice(KINDS), rng.randint(1, MAX_RECORDS))
        return ep.ids[-seq_len:]


def episodes(tok, stream, kind: str, count: int, seed: int, length: int = 512) -> list[Episode]:
    """`count` held-out episodes of `kind`, records cycling 1..MAX_RECORDS (answers of every
    bucket), each `length` tokens long: code from `stream` (held-out files), files from `seed`."""
    task, rng = CopyTask(tok), random.Random(seed)
    return [task.fitted(rng, stream, length, kind, 1 + i % MAX_RECORDS) for i in range(count)]


def heldout_stream(folder: Path):
    """The held-out standard-library files (`eval.corpus.corpus_split`) in the model's tokenizer."""
    from tokenizers import Tokenizer

    from eval.corpus import corpus_split, encode_files

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    _, held = corpus_split()
    return tok, encode_files(tok, held, tok.token_to_id("<|endoftext|>"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.copy_task", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("checkpoints/tiny-mimo-copy"),
                   help="the model whose tokenizer to use (default: %(default)s)")
    p.add_argument("--kind", choices=KINDS, default="near", help="where the spans sit (default: %(default)s)")
    p.add_argument("--count", type=int, default=3, help="episodes to print (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the files and code offsets (default: %(default)s)")
    args = p.parse_args(argv)
    tok, stream = heldout_stream(args.model)
    for ep in episodes(tok, stream, args.kind, args.count, args.seed):
        text = tok.decode(ep.ids, skip_special_tokens=False)
        print(f"--- {ep.kind}, {ep.records} files, prompt {ep.prompt_len} tokens, answer {ep.answer_len} tokens")
        print(text[-900:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
