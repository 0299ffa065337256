"""Anchors and metrics through a real `vllm serve` of the tiny MiMo model on 127.0.0.1.

One server with the plugin on (and a pin file), one with it off for upstream's default on the
same requests. The cache is large enough that nothing is evicted: every miss below is a
missing SWA window, which is what the plugin's anchors are for. Hits are read as users read
them, with the real `openai` and `anthropic` clients: `--enable-prompt-tokens-details` makes
usage report the window-safe hit (`prompt_tokens_details.cached_tokens`, and
`cache_read_input_tokens` on `/v1/messages`).
"""

from __future__ import annotations

import json
import time

import anthropic
import openai
import pytest
import requests

from vllm_mimo.testing.server import VllmServer

pytestmark = pytest.mark.engine  # starts real vLLM engines: the slow lane (`make check` skips it)

BLOCK = 128  # vLLM's CPU block size
PINNED_SYSTEM = "You are the release manager of a large Python project. " * 20
SHARED_SYSTEM = "You review pull requests for a numerical library, strictly and briefly. " * 18
DOCUMENT = "def parse(text):\n    return [line.split(',') for line in text.splitlines()]\n" * 20
# The first question is over a block long, so the first prompt ends a block or more past where
# the second one leaves it: upstream's prompt-end SWA tail does not cover the junction.
QUESTIONS = ["Explain, line by line, what this code does and why. " * 12,
             "Rewrite it with the csv module, and keep the same behaviour please."]
ARGS = ("--enforce-eager", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
        "--enable-prompt-tokens-details", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    pin_file = tmp_path_factory.mktemp("pins") / "pins.jsonl"
    pin_file.write_text(json.dumps({"messages": [{"role": "system", "content": PINNED_SYSTEM}]}) + "\n")
    on = VllmServer(tiny_models["mimo"], *ARGS, "--additional-config",
                    json.dumps({"mimo": {"pin_prompts_file": str(pin_file)}}))
    off = VllmServer(tiny_models["mimo"], *ARGS, env={"VLLM_MIMO_ENABLE": "0"})
    with on, off:
        _wait_for_pins(on)
        yield {"on": on, "off": off}


def _wait_for_pins(server: VllmServer, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.metrics().get("vllm:mimo_anchors_kept_total", 0) >= 1:
            return
        time.sleep(0.5)
    raise AssertionError(f"the pinned prompt was not anchored in {timeout_s} s:\n{server.tail()}")


def _chat(server: VllmServer, messages: list[dict]) -> int:
    """Send a chat completion with the OpenAI client; return its cached prompt tokens."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    usage = client.chat.completions.create(model="tiny", messages=messages, max_tokens=160, temperature=0).usage
    assert usage is not None and usage.prompt_tokens_details is not None, usage
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None, usage
    return cached


def _tokens(server: VllmServer, messages: list[dict]) -> int:
    r = requests.post(server.url + "/tokenize", json={"model": "tiny", "messages": messages, "add_generation_prompt": False})
    r.raise_for_status()
    return r.json()["count"]


def test_first_sibling_hits_the_system_prompt_through_the_chat_api(servers):
    system = [{"role": "system", "content": SHARED_SYSTEM}]
    hits = {}
    for side, server in servers.items():
        first = _chat(server, system + [{"role": "user", "content": QUESTIONS[0]}])
        second = _chat(server, system + [{"role": "user", "content": QUESTIONS[1]}])
        hits[side] = (first, second)
    system_tokens = _tokens(servers["on"], system)
    assert hits["on"] == (0, system_tokens // BLOCK * BLOCK)
    assert hits["off"] == (0, 0)  # upstream's default: the first sibling recomputes it


def test_pinned_prompt_makes_the_very_first_request_hit(servers):
    system = [{"role": "system", "content": PINNED_SYSTEM}]
    assert _chat(servers["on"], system + [{"role": "user", "content": QUESTIONS[0]}]) == (
        _tokens(servers["on"], system) // BLOCK * BLOCK
    )


def test_cache_control_block_is_an_anchor_in_chat_completions(servers):
    def user(question: str) -> list[dict]:
        return [{"role": "user", "content": [
            {"type": "text", "text": DOCUMENT, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": question},
        ]}]

    server = servers["on"]
    assert _chat(server, user(QUESTIONS[0])) == 0
    document_end = _tokens(server, [{"role": "user", "content": DOCUMENT}]) - 2  # minus "<|im_end|>\n"
    assert _chat(server, user(QUESTIONS[1])) == document_end // BLOCK * BLOCK


def test_cache_control_block_is_an_anchor_in_messages(servers):
    server = servers["on"]

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)

    def send(question: str) -> int:
        """Send a message with the Anthropic client; return its cache-read input tokens."""
        message = client.messages.create(
            model="tiny", max_tokens=160,
            system=[{"type": "text", "text": "Be brief. " * 4}],
            messages=[{"role": "user", "content": [
                {"type": "text", "text": DOCUMENT.upper(), "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": question},
            ]}],
            extra_body={"temperature": 0},  # this client no longer takes `temperature`; vLLM does
        )
        return message.usage.cache_read_input_tokens or 0  # vLLM leaves it out when nothing was read

    assert send(QUESTIONS[0]) == 0
    assert send(QUESTIONS[1]) >= 4 * BLOCK  # the system text and the marked document


def test_manager_metrics_on_the_metrics_endpoint(servers):
    text = requests.get(servers["on"].url + "/metrics", timeout=10).text
    for name in ("vllm:mimo_window_safe_hit_tokens_total", "vllm:mimo_pseudo_hit_tokens_total",
                 "vllm:mimo_recomputed_swa_tokens_total", "vllm:mimo_prefill_steps_cut_total",
                 "vllm:mimo_anchors_kept_total{",
                 'kind="declared"', "vllm:mimo_pool_used_blocks{", 'pool="swa"', 'pool="full"',
                 "vllm:mimo_pool_evicted_blocks_total"):
        assert name in text, name
    assert "vllm:mimo_" not in requests.get(servers["off"].url + "/metrics", timeout=10).text
