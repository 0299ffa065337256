"""A served soak: `vllm serve` with the plugin under concurrent chat sessions, clients that go
away and bad input, then every block back, the KV manager's invariants, and the answers of the
completed turns against the plugin off.

    python -m eval.soak [--minutes M] [--sessions N] [--model DIR] [--kv-gib G] [--host-gib H]
        [--seed S] [--json OUT]

One `vllm serve` of the tiny MiMo (float32, a small KV cache, a host tier, a pinned system
prompt, `check_integrity_at_idle`) on 127.0.0.1. `--sessions` clients run for `--minutes`, each
a chat session of short turns (streaming or not) over either the pinned system prompt or one of
its own, and now and then, by a seeded draw:

  * disconnect mid-stream (the server aborts the running request);
  * cancel a request while it may still be queued (the client gives up after 50 ms);
  * send a prompt over max_model_len, malformed `vllm_xargs` anchors, or a malformed
    `cache_control` block: each must get an HTTP 4xx whose message names what is wrong.

Afterwards: the server must still answer; `/metrics` must show no block held (`held_blocks`)
and every integrity check at idle passed (each is logged by the engine); and a plugin-off server
(float32, same KV bytes) given each completed turn's messages must answer with the same tokens.
Prints a table (requests, aborted, rejected by reason, unexpected errors, hit tokens, pseudo
hits, blocks held after, integrity checks and violations, answers compared and differing) and
writes it as JSON with `--json`. Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

GIB = 1 << 30
MAX_MODEL_LEN = 1024
MODEL_NAME = "soak"
PINNED_SYSTEM = "You are the on-call engineer for a payments platform; answer in one short line. " * 8
WORDS = ("queue", "retry", "ledger", "timeout", "refund", "shard", "replica", "batch", "token", "cache",
         "deploy", "rollback", "invoice", "webhook", "latency", "quota")
MAX_UNEXPECTED = 50  # then the clients stop (a dead server would otherwise be hammered)
# Bad input: (reason, the text the 4xx message must contain).
BAD_INPUTS = {
    "over max_model_len": "maximum context length",
    "malformed anchors": 'extra_args["mimo"]["anchors"] must be a list of positive token positions',
    "malformed cache_control": "cache_control must be",
}


@dataclass
class SoakResult:
    minutes: float
    sessions: int
    requests: int = 0
    completed: int = 0
    aborted_mid_stream: int = 0
    cancelled: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    hit_tokens: int = 0
    pseudo_hit_tokens: int = 0
    withdrawn_positions: int = 0
    held_blocks_after: float = -1
    integrity_checks: int = 0
    integrity_violations: int = 0
    still_answers: bool = False
    compared: int = 0
    differing: int = 0

    def failures(self) -> list[str]:
        out = [f"unexpected: {u}" for u in self.unexpected[:5]]
        if self.held_blocks_after != 0:
            out.append(f"{self.held_blocks_after:g} blocks held after the soak")
        if self.integrity_checks == 0 or self.integrity_violations:
            out.append(f"integrity: {self.integrity_violations} violations in {self.integrity_checks} checks")
        if not self.still_answers:
            out.append("the server no longer answers")
        if self.differing or not self.compared:
            out.append(f"{self.differing} of {self.compared} completed turns differ from the plugin off")
        missing = [reason for reason in BAD_INPUTS if not self.rejected.get(reason)]
        if missing:
            out.append(f"bad input never sent: {missing}")
        return out


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Soak:
    """The clients: one task per session, sharing one result."""

    def __init__(self, url: str, result: SoakResult, seed: int, deadline: float) -> None:
        self.url, self.result, self.seed, self.deadline = url, result, seed, deadline
        self.turns: list[dict] = []  # completed turns: messages, max_tokens, token ids
        self.bad_inputs = 0

    def _unexpected(self, what: str) -> None:
        self.result.unexpected.append(what)
        print(f"[soak] unexpected: {what}", file=sys.stderr, flush=True)
        if len(self.result.unexpected) == MAX_UNEXPECTED:
            print(f"[soak] {MAX_UNEXPECTED} unexpected errors: stopping the clients", file=sys.stderr, flush=True)
            self.deadline = 0.0

    async def session(self, client, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while time.monotonic() < self.deadline:
            system = PINNED_SYSTEM if rng.random() < 0.5 else f"Session {index}-{rng.randrange(10**6)}: " + _words(rng, 60)
            messages = [{"role": "system", "content": system}]
            # At most ~700 tokens of history: the prompts stay under max_model_len.
            for _ in range(rng.randint(2, 5)):
                if time.monotonic() >= self.deadline:
                    return
                draw = rng.random()
                if draw < 0.06:
                    await self.bad_input(client, rng, messages)
                    continue
                messages = messages + [{"role": "user", "content": _words(rng, rng.randint(10, 40))}]
                if draw < 0.12:
                    await self.disconnect(client, messages)
                    break
                if draw < 0.17:
                    await self.cancel(client, messages)
                    break
                answer = await self.turn(client, messages, rng.choice((8, 16, 32)), stream=rng.random() < 0.5)
                if answer is None:
                    break
                messages = messages + [{"role": "assistant", "content": answer}]

    def _body(self, messages: list[dict], max_tokens: int, stream: bool) -> dict:
        return {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": stream, "return_token_ids": True, "ignore_eos": True}

    async def turn(self, client, messages: list[dict], max_tokens: int, stream: bool) -> str | None:
        self.result.requests += 1
        body = self._body(messages, max_tokens, stream)
        try:
            if stream:
                text, ids = [], []
                async with client.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=600) as r:
                    if r.status_code != 200:
                        self._unexpected(f"turn: HTTP {r.status_code} {(await r.aread())[:200]!r}")
                        return None
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        for choice in json.loads(line[6:]).get("choices", []):
                            text.append(choice.get("delta", {}).get("content") or "")
                            ids += choice.get("token_ids") or []
                answer = "".join(text)
            else:
                r = await client.post(self.url + "/v1/chat/completions", json=body, timeout=600)
                if r.status_code != 200:
                    self._unexpected(f"turn: HTTP {r.status_code} {r.text[:200]!r}")
                    return None
                choice = r.json()["choices"][0]
                answer, ids = choice["message"]["content"] or "", choice.get("token_ids") or []
        except Exception as e:
            self._unexpected(f"turn: {type(e).__name__}: {e}")
            return None
        if len(ids) != max_tokens:
            self._unexpected(f"turn: {len(ids)} token ids for max_tokens {max_tokens}")
        self.result.completed += 1
        self.turns.append({"messages": messages, "max_tokens": max_tokens, "ids": ids})
        return answer

    async def disconnect(self, client, messages: list[dict]) -> None:
        """Stream a long answer and go away after its first chunks."""
        self.result.requests += 1
        try:
            async with client.stream(
                "POST", self.url + "/v1/chat/completions", json=self._body(messages, 200, True), timeout=600
            ) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if chunks >= 3:
                        break
            self.result.aborted_mid_stream += 1
        except Exception as e:
            self._unexpected(f"disconnect: {type(e).__name__}: {e}")

    async def cancel(self, client, messages: list[dict]) -> None:
        """Give up after 50 ms, most often while the request waits for the engine."""
        import httpx

        self.result.requests += 1
        try:
            await client.post(self.url + "/v1/chat/completions", json=self._body(messages, 64, False), timeout=0.05)
            self.result.completed += 1  # answered within 50 ms: not cancelled after all
        except httpx.TimeoutException:
            self.result.cancelled += 1
        except Exception as e:
            self._unexpected(f"cancel: {type(e).__name__}: {e}")

    async def bad_input(self, client, rng: random.Random, messages: list[dict]) -> None:
        reasons = sorted(BAD_INPUTS)  # in turn, so that a short soak sends each
        reason = reasons[self.bad_inputs % len(reasons)]
        self.bad_inputs += 1
        body = self._body(messages + [{"role": "user", "content": "hello"}], 8, False)
        if reason == "over max_model_len":
            body["messages"] = messages + [{"role": "user", "content": _words(rng, MAX_MODEL_LEN + 100)}]
        elif reason == "malformed anchors":
            body["vllm_xargs"] = {"mimo": json.dumps({"anchors": "after the system prompt"})}
        else:
            body["messages"] = messages + [
                {"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": {"type": "forever"}}]}
            ]
        self.result.requests += 1
        try:
            r = await client.post(self.url + "/v1/chat/completions", json=body, timeout=600)
        except Exception as e:
            self._unexpected(f"{reason}: {type(e).__name__}: {e}")
            return
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        if 400 <= r.status_code < 500 and BAD_INPUTS[reason] in message:
            self.result.rejected[reason] = self.result.rejected.get(reason, 0) + 1
        else:
            self._unexpected(f"{reason}: HTTP {r.status_code} {message[:300]!r}")


async def _drive(url: str, result: SoakResult, seed: int, minutes: float, sessions: int) -> list[dict]:
    import httpx

    soak = Soak(url, result, seed, time.monotonic() + minutes * 60)

    async def progress() -> None:
        start = time.monotonic()
        while time.monotonic() < soak.deadline:
            await asyncio.sleep(15)
            print(f"[soak] {time.monotonic() - start:.0f} s: {result.requests} requests, {result.completed} completed, "
                  f"{result.aborted_mid_stream + result.cancelled} aborted, {sum(result.rejected.values())} rejected, "
                  f"{len(result.unexpected)} unexpected", file=sys.stderr, flush=True)

    limits = httpx.Limits(max_connections=sessions * 2)
    async with httpx.AsyncClient(limits=limits) as client:
        ticker = asyncio.create_task(progress())
        await asyncio.gather(*(soak.session(client, i) for i in range(sessions)))
        ticker.cancel()
    return soak.turns


async def _replay(url: str, turns: list[dict]) -> list[list[int]]:
    """The completed turns' token ids from another server, four at a time."""
    import httpx

    limit = asyncio.Semaphore(4)

    async def one(client, turn: dict) -> list[int]:
        async with limit:
            body = {"model": MODEL_NAME, "messages": turn["messages"], "max_tokens": turn["max_tokens"],
                    "temperature": 0, "return_token_ids": True, "ignore_eos": True}
            r = await client.post(url + "/v1/chat/completions", json=body, timeout=600)
            r.raise_for_status()
            return r.json()["choices"][0].get("token_ids") or []

    async with httpx.AsyncClient() as client:
        return await asyncio.gather(*(one(client, t) for t in turns))


def _server_args(model: str, kv_bytes: int) -> list[str]:
    return [model, "--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(kv_bytes), "--served-model-name", MODEL_NAME,
            "--enable-prompt-tokens-details"]


def run(model: str, minutes: float, sessions: int, kv_gib: float, host_gib: float, seed: int) -> SoakResult:
    import requests

    from vllm_mimo.testing.server import VllmServer

    result = SoakResult(minutes=minutes, sessions=sessions)
    pins = Path(tempfile.mkdtemp(prefix="soak-")) / "pins.jsonl"
    pins.write_text(json.dumps({"messages": [{"role": "system", "content": PINNED_SYSTEM}]}) + "\n")
    mimo = {"host_tier_gib": host_gib, "pin_prompts_file": str(pins), "check_integrity_at_idle": True}
    kv_bytes = int(kv_gib * GIB)
    print("[soak] starting vllm serve with the plugin (about 30 s) ...", file=sys.stderr, flush=True)
    with VllmServer(*_server_args(model, kv_bytes), "--additional-config", json.dumps({"mimo": mimo})) as server:
        before = server.metrics()
        turns = asyncio.run(_drive(server.url, result, seed, minutes, sessions))
        # The server still answers, and that request's step leaves the engine idle: its
        # integrity check runs after it.
        r = requests.post(server.url + "/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}, timeout=120)
        result.still_answers = r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"] or "") > 0
        time.sleep(2.0)  # the engine publishes its counters when it goes idle
        after = server.metrics()
        log = server.log_text()
    for line in log.splitlines():
        if "integrity check at idle" in line and "VIOLATION" in line:
            print(f"[soak] {line}", file=sys.stderr)

    def delta(name: str) -> int:
        return int(after.get(name, 0.0) - before.get(name, 0.0))

    result.hit_tokens = delta("vllm:mimo_window_safe_hit_tokens_total")
    result.pseudo_hit_tokens = delta("vllm:mimo_pseudo_hit_tokens_total")
    result.withdrawn_positions = delta("vllm:mimo_withdrawn_positions_total")
    result.held_blocks_after = after.get("vllm:mimo_held_blocks", -1)
    result.integrity_checks = int(after.get("vllm:mimo_integrity_checks_total", 0))
    result.integrity_violations = int(after.get("vllm:mimo_integrity_violations_total", 0))
    print(
        f"[soak] replaying {len(turns)} completed turns on the plugin off (about 30 s to start) ...", file=sys.stderr, flush=True
    )
    with VllmServer(*_server_args(model, kv_bytes), env={"VLLM_MIMO_ENABLE": "0"}) as off:
        reference = asyncio.run(_replay(off.url, turns))
    result.compared = len(turns)
    result.differing = sum(turn["ids"] != ids for turn, ids in zip(turns, reference, strict=True))
    return result


def print_table(result: SoakResult) -> None:
    rows = [
        ("requests", result.requests),
        ("completed", result.completed),
        ("aborted mid-stream", result.aborted_mid_stream),
        ("cancelled (50 ms)", result.cancelled),
        *((f"rejected: {reason}", result.rejected.get(reason, 0)) for reason in BAD_INPUTS),
        ("unexpected errors", len(result.unexpected)),
        ("window-safe hit tokens", result.hit_tokens),
        ("pseudo-hit tokens", result.pseudo_hit_tokens),
        ("withdrawn positions", result.withdrawn_positions),
        ("blocks held after", f"{result.held_blocks_after:g}"),
        ("integrity checks at idle", result.integrity_checks),
        ("integrity violations", result.integrity_violations),
        ("server answers after", "yes" if result.still_answers else "NO"),
        ("turns compared with plugin off", result.compared),
        ("turns with other tokens", result.differing),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"\nsoak: {result.minutes:g} min, {result.sessions} sessions")
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>10}")
    failures = result.failures()
    print("\nresult: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the clients run, > 0 (default: 10)")
    parser.add_argument("--sessions", type=int, default=8, help="concurrent chat sessions, 1-64 (default: 8)")
    parser.add_argument("--model", help="model folder (default: the bundled trained tiny MiMo, else a fresh tiny mimo)")
    parser.add_argument("--kv-gib", type=float, default=0.01,
                        help="device KV cache in GiB, > 0 (default: 0.01, small enough to evict and preempt)")
    parser.add_argument("--host-gib", type=float, default=0.02, help="host tier in GiB, >= 0 (default: 0.02; 0: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' draws (default: 0)")
    parser.add_argument("--json", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    for name, value, ok, allowed in (
        ("--minutes", args.minutes, args.minutes > 0, "> 0"),
        ("--sessions", args.sessions, 1 <= args.sessions <= 64, "1-64"),
        ("--kv-gib", args.kv_gib, args.kv_gib > 0, "> 0"),
        ("--host-gib", args.host_gib, args.host_gib >= 0, ">= 0"),
    ):
        if not ok:
            parser.error(f"{name} {value} is out of range; allowed: {allowed}")
    from eval.bench_serve import bundled_model

    model = args.model or str(bundled_model())
    result = run(model, args.minutes, args.sessions, args.kv_gib, args.host_gib, args.seed)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps({**asdict(result), "model": model, "kv_gib": args.kv_gib,
                                         "host_gib": args.host_gib, "seed": args.seed}, indent=2) + "\n")
    return 1 if result.failures() else 0


if __name__ == "__main__":
    raise SystemExit(main())
