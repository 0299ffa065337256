"""Seeded agentic workloads and Mooncake-format traces, as token-level requests.

    python -m eval.workloads NAME --write-mooncake OUT.jsonl [--seed S] [--scale X]

A request's prompt is a tuple of `Segment`s (seeded pseudo-random token runs), so shared
prefixes are shared segments and nothing is materialised until the replay needs the tokens.

Workloads:
  shared-system-prompt  a few ~2,000-token system prompts shared by many users; each user is a
                        multi-turn session whose next prompt is the previous prompt, the answer
                        and a new message; outputs of 20-150 tokens, like tool calls.
  agent-sessions        agent loops: a shared tool prompt, then steps that append a tool result
                        and a short answer, growing to 32K tokens and more.
  mixed                 both, plus unrelated one-shot prompts.
  long-conversations    120 long conversations (prompts of 5-30K tokens growing turn by turn)
                        on 512-token blocks, a third of them forking an earlier one.
  long-conversations-shared
                        the same, most of the others starting from shared system prompts.

Mooncake format (FAST'25 trace): one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids`, each id a 512-token block, equal ids = equal
tokens (ids are chained: an id also fixes everything before it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK = 512
VOCAB = (1000, 60000)  # token ids drawn from this range


@dataclass(frozen=True)
class Segment:
    """`length` tokens drawn from a generator seeded with `key`."""

    key: int
    length: int


@dataclass(frozen=True)
class ReplayRequest:
    arrival_s: float
    prompt: tuple[Segment, ...]
    output: Segment
    """The tokens the engine will "generate" (a later turn's prompt may contain them)."""

    @property
    def prompt_len(self) -> int:
        return sum(s.length for s in self.prompt)


@lru_cache(maxsize=4096)
def segment_tokens(segment: Segment) -> tuple[int, ...]:
    rng = np.random.default_rng(segment.key)
    size = max(segment.length, MOONCAKE_BLOCK) if segment.key >= MOONCAKE_KEY_BASE else segment.length
    return tuple(rng.integers(*VOCAB, size=size)[: segment.length].tolist())


def tokens(segments: tuple[Segment, ...]) -> list[int]:
    out: list[int] = []
    for segment in segments:
        out.extend(segment_tokens(segment))
    return out


MOONCAKE_KEY_BASE = 1 << 40  # keys of Mooncake blocks: base + hash id


class _Keys:
    """Fresh segment keys from one seeded stream."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self._next = seed * 1_000_003 + 1

    def segment(self, low: int, high: int) -> Segment:
        self._next += 1
        return Segment(self._next, int(self.rng.integers(low, high + 1)))

    def blocks(self, length: int) -> tuple[Segment, ...]:
        """`length` fresh tokens as Mooncake-style 512-token blocks (the last one partial)."""
        out = []
        while length > 0:
            self._next += 1
            out.append(Segment(self._next, min(MOONCAKE_BLOCK, length)))
            length -= MOONCAKE_BLOCK
        return tuple(out)


def shared_system_prompt(seed: int, scale: float = 1.0, start_s: float = 0.0, keys: _Keys | None = None) -> list[ReplayRequest]:
    keys = keys or _Keys(seed)
    rng = keys.rng
    systems = [keys.segment(1500, 2500) for _ in range(6)]
    popularity = 1.0 / np.arange(1, len(systems) + 1)  # Zipf: a few prompts are most users'
    popularity /= popularity.sum()
    requests = []
    users = max(2, int(150 * scale))
    t = start_s
    for _ in range(users):
        t += float(rng.exponential(0.8))
        prompt: tuple[Segment, ...] = (systems[int(rng.choice(len(systems), p=popularity))],)
        arrival = t
        for _ in range(int(rng.integers(2, 7))):
            prompt = prompt + (keys.segment(30, 400),)
            output = keys.segment(20, 150)
            requests.append(ReplayRequest(arrival, prompt, output))
            prompt = prompt + (output,)
            arrival += float(rng.uniform(8, 40))  # the user reads and types
    return requests


def agent_sessions(seed: int, scale: float = 1.0, start_s: float = 0.0, keys: _Keys | None = None) -> list[ReplayRequest]:
    keys = keys or _Keys(seed + 17)
    rng = keys.rng
    tool_prompts = [keys.segment(2500, 4000) for _ in range(3)]
    requests = []
    t = start_s
    for _ in range(max(1, int(14 * scale))):
        t += float(rng.exponential(6.0))
        prompt: tuple[Segment, ...] = (tool_prompts[int(rng.integers(len(tool_prompts)))], keys.segment(100, 600))
        arrival = t
        target = int(rng.integers(24_000, 40_000))
        while True:
            output = keys.segment(20, 150)
            requests.append(ReplayRequest(arrival, prompt, output))
            prompt = prompt + (output, keys.segment(200, 2000))  # the answer, then a tool result
            arrival += float(rng.uniform(2, 8))
            if sum(s.length for s in prompt) > target:
                break
    return requests


def one_shot(seed: int, scale: float = 1.0, keys: _Keys | None = None, span_s: float = 600.0) -> list[ReplayRequest]:
    keys = keys or _Keys(seed + 31)
    rng = keys.rng
    return [
        ReplayRequest(float(rng.uniform(0, span_s)), (keys.segment(500, 4000),), keys.segment(20, 300))
        for _ in range(max(1, int(60 * scale)))
    ]


def long_conversations(seed: int, scale: float = 1.0, shared_share: float = 0.0) -> list[ReplayRequest]:
    """Many long multi-turn conversations, shaped like public Mooncake conversation traces: a
    first prompt of 5-12K tokens (a pasted document or code), then turns that each add 300-3,000
    tokens (the answer and a new message) until the prompt reaches 12-30K. As in those traces
    the content is 512-token blocks and a next turn's prompt keeps only the previous prompt's
    whole blocks (its partial last block is re-blocked with the new tokens), so junctions fall
    on 512-token boundaries and the answer is not in the next prompt; requests are sent at
    their timestamps, a turn 20-90 s after the previous one. A third of the conversations fork
    an earlier one (a regenerated answer, an edited message, another question on the same
    document): they start from a whole-block prefix of one of its prompts, cut at a random
    512-token boundary. `shared_share`: the share of the other conversations that start from
    one of eight shared 1-4K-token system prompts (Zipf); the rest start fresh."""
    keys = _Keys(seed + 71)
    rng = keys.rng
    systems = [keys.blocks(int(rng.integers(2, 9)) * MOONCAKE_BLOCK) for _ in range(8)]
    popularity = 1.0 / np.arange(1, len(systems) + 1)
    popularity /= popularity.sum()
    requests = []
    t = 0.0
    for _ in range(max(1, int(120 * scale))):
        t += float(rng.exponential(16.0))
        if requests and rng.random() < 1 / 3:
            earlier = requests[int(rng.integers(len(requests)))].prompt
            start = earlier[: int(rng.integers(1, len(earlier) + 1))]
            if start[-1].length < MOONCAKE_BLOCK:
                start = start[:-1] or earlier[:1]
        else:
            start = systems[int(rng.choice(len(systems), p=popularity))] if rng.random() < shared_share else ()
        prompt = start + keys.blocks(max(MOONCAKE_BLOCK, int(rng.integers(5_000, 12_000)) - sum(s.length for s in start)))
        target = int(rng.integers(12_000, 30_000))
        arrival = t
        while True:
            output = keys.segment(50, 600)
            requests.append(ReplayRequest(arrival, prompt, output))
            length = sum(s.length for s in prompt)
            if length >= target:
                break
            whole = prompt if prompt[-1].length == MOONCAKE_BLOCK else prompt[:-1]
            carried = length - sum(s.length for s in whole)
            prompt = whole + keys.blocks(carried + int(rng.integers(300, 3_000)))
            arrival += float(rng.uniform(20, 90))
    return requests


def long_conversations_shared(seed: int, scale: float = 1.0) -> list[ReplayRequest]:
    return long_conversations(seed, scale, shared_share=0.6)


def mixed(seed: int, scale: float = 1.0) -> list[ReplayRequest]:
    keys = _Keys(seed + 51)
    return (
        shared_system_prompt(seed, scale * 0.6, keys=keys)
        + agent_sessions(seed, scale * 0.6, keys=keys)
        + one_shot(seed, scale, keys=keys)
    )


WORKLOADS: dict[str, Callable[..., list[ReplayRequest]]] = {
    "shared-system-prompt": shared_system_prompt,
    "agent-sessions": agent_sessions,
    "mixed": mixed,
    "long-conversations": long_conversations,
    "long-conversations-shared": long_conversations_shared,
}


def make_workload(name: str, seed: int = 0, scale: float = 1.0) -> list[ReplayRequest]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    return sorted(WORKLOADS[name](seed, scale), key=lambda r: r.arrival_s)


def previous_turns(requests: list[ReplayRequest]) -> list[int | None]:
    """Per request, the latest earlier request whose answer its prompt contains (its session's
    previous turn), or None. Mooncake traces carry no answers, so their requests have none."""
    answered_by: dict[Segment, int] = {}
    out: list[int | None] = []
    for i, r in enumerate(requests):
        found = [answered_by[s] for s in r.prompt if s in answered_by]
        out.append(max(found) if found else None)
        answered_by[r.output] = i
    return out


# ------------------------------------------------------------------ Mooncake traces


class TraceError(ValueError):
    """A malformed Mooncake trace line."""


def write_mooncake(requests: list[ReplayRequest], path: Path) -> None:
    """Write requests as a Mooncake trace: 512-token blocks get chained ids by content."""
    ids: dict[tuple, int] = {}
    with open(path, "w") as f:
        for r in requests:
            toks = tokens(r.prompt)
            hash_ids, prev = [], -1
            for start in range(0, len(toks), MOONCAKE_BLOCK):
                key = (prev, tuple(toks[start : start + MOONCAKE_BLOCK]))
                prev = ids.setdefault(key, len(ids))
                hash_ids.append(prev)
            f.write(
                json.dumps(
                    {
                        "timestamp": round(r.arrival_s * 1000),
                        "input_length": len(toks),
                        "output_length": r.output.length,
                        "hash_ids": hash_ids,
                    }
                )
                + "\n"
            )


def read_mooncake(path: Path) -> list[ReplayRequest]:
    """Read a Mooncake trace; a malformed line stops with the file and line number."""
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e})") from None
            for field in ("timestamp", "input_length", "output_length", "hash_ids"):
                if field not in record:
                    raise TraceError(f"{where}: missing field {field!r}")
            n_in, n_out, hash_ids = record["input_length"], record["output_length"], record["hash_ids"]
            for field, value in (("timestamp", record["timestamp"]), ("input_length", n_in), ("output_length", n_out)):
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                    raise TraceError(f"{where}: {field} must be a non-negative number, got {value!r}")
            if n_in < 1 or n_out < 1:
                raise TraceError(f"{where}: input_length and output_length must be >= 1")
            if not isinstance(hash_ids, list) or not all(isinstance(h, int) and h >= 0 for h in hash_ids):
                raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
            need = -(-int(n_in) // MOONCAKE_BLOCK)
            if len(hash_ids) < need:
                raise TraceError(
                    f"{where}: input_length {n_in} needs {need} hash ids of {MOONCAKE_BLOCK} tokens, "
                    f"got {len(hash_ids)}"
                )
            blocks = [Segment(MOONCAKE_KEY_BASE + h, MOONCAKE_BLOCK) for h in hash_ids[:need]]
            tail = int(n_in) - MOONCAKE_BLOCK * (need - 1)
            blocks[-1] = Segment(blocks[-1].key, tail)
            output = Segment(MOONCAKE_KEY_BASE * 2 + lineno, int(n_out))
            requests.append(ReplayRequest(record["timestamp"] / 1000.0, tuple(blocks), output))
    if not requests:
        raise TraceError(f"{path}: no requests")
    return sorted(requests, key=lambda r: r.arrival_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.workloads", description="Write a workload as a Mooncake-format trace.")
    parser.add_argument("workload", choices=sorted(WORKLOADS), help="which workload to generate")
    parser.add_argument("--write-mooncake", required=True, metavar="OUT.jsonl", help="trace file to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--scale", type=float, default=1.0, help="size multiplier, > 0 (default: 1.0)")
    args = parser.parse_args(argv)
    if not args.scale > 0:
        parser.error(f"--scale {args.scale} must be > 0")
    requests = make_workload(args.workload, args.seed, args.scale)
    write_mooncake(requests, Path(args.write_mooncake))
    print(f"wrote {len(requests)} requests to {args.write_mooncake}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ---------------------------------------------------------------- served chat sessions

WORDS = (
    "the of and to in is for that with on as it be by this are from at or an not which have "
    "file function return value list dict string module class test error type path data index "
    "request server model cache token window layer block prefix session user system answer "
    "call tool result check build run parse write read open close start stop time size memory"
).split()


@dataclass(frozen=True)
class ChatSession:
    """A user's conversation for `eval.bench_serve`: each turn's answer is whatever the model
    generates, and goes into the next turn's history."""

    start_s: float
    system: str
    turns: tuple[tuple[str, int], ...]
    """(user message, max tokens of the answer) per turn."""


def _text(rng: np.random.Generator, words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=words)) + "."


def chat_sessions(name: str, seed: int = 0, sessions: int = 8, span_s: float = 20.0) -> list[ChatSession]:
    """Chat-shaped versions of the workloads, sized for a small served model (2K context).

    shared-system-prompt: three ~1,500-word system prompts shared by many users, 3-4 turns each;
    agent-sessions: a ~1,200-word tool prompt, then steps that add ~120-word tool results;
    mixed: both, alternating, plus one-shot questions with their own system prompt.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    rng = np.random.default_rng(seed)
    systems = [_text(rng, 1500) for _ in range(3)]
    tool_prompt = "You are an agent. Tools: " + _text(rng, 1200)
    out = []
    for i in range(sessions):
        start = float(rng.uniform(0, span_s))
        kind = name if name != "mixed" else ("shared-system-prompt", "agent-sessions", "one-shot")[i % 3]
        if kind == "shared-system-prompt":
            turns = tuple(
                (_text(rng, int(rng.integers(15, 60))), int(rng.integers(20, 80))) for _ in range(int(rng.integers(3, 5)))
            )
            out.append(ChatSession(start, systems[int(rng.integers(len(systems)))], turns))
        elif kind == "agent-sessions":
            turns = ((_text(rng, 40), 40),) + tuple(("Tool result: " + _text(rng, 120), 30) for _ in range(3))
            out.append(ChatSession(start, tool_prompt, turns))
        else:
            out.append(ChatSession(start, _text(rng, 300), ((_text(rng, 50), 60),)))
    return sorted(out, key=lambda s: s.start_s)
