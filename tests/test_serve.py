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
import re
import time
from pathlib import Path

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
    # With a plugin variable set, vLLM's strict check of VLLM_* variables passes.
    on = VllmServer(tiny_models["mimo"], *ARGS, "--fail-on-environ-validation", "--additional-config",
                    json.dumps({"mimo": {"pin_prompts_file": str(pin_file)}}), env={"VLLM_MIMO_SYSTEM_PROMPT_ANCHOR": "1"})
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


def test_plugin_environment_variables_are_known_to_vllm(servers):
    """The plugin-on server started with `--fail-on-environ-validation` and a plugin variable
    set; neither server (the other has VLLM_MIMO_ENABLE=0) warned about an unknown variable."""
    for server in servers.values():
        assert "Unknown vLLM environment variable" not in server.log_text()


def _bad_request(server: VllmServer, path: str, body: dict) -> dict:
    """POST a request the plugin must refuse; returns its error object (status 400 checked)."""
    r = requests.post(server.url + path, json={"model": "tiny", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    return error


def test_anchor_hint_past_the_prompt_is_a_400_naming_position_and_length(servers):
    server = servers["on"]
    prompt = "def parse(text):"
    length = requests.post(server.url + "/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=10).json()["count"]
    error = _bad_request(server, "/v1/completions",
                         {"prompt": prompt, "vllm_xargs": {"mimo": json.dumps({"anchors": [4, 99999]})}})
    assert "position 99999 is past the end of the prompt" in error["message"], error
    assert f"which has {length} tokens" in error["message"], error
    assert error["param"] == 'extra_args["mimo"]', error
    # The prompt's own end is an anchor position like any other.
    ok = requests.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "vllm_xargs": {"mimo": json.dumps({"anchors": [length]})}})
    assert ok.status_code == 200, ok.text


def test_every_plugin_400_names_its_param(servers):
    server = servers["on"]
    malformed = _bad_request(server, "/v1/completions", {"prompt": "x", "vllm_xargs": {"mimo": json.dumps({"anchors": [-1]})}})
    assert malformed["param"] == 'extra_args["mimo"]', malformed
    bad_mark = {"type": "text", "text": "hello", "cache_control": {"type": "persistent"}}
    chat = _bad_request(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [bad_mark]}]})
    assert chat["param"] == "messages[0].content[0].cache_control", chat
    assert "cache_control must be" in chat["message"], chat
    # Anthropic's error object has no `param`: the message names the place.
    messages = _bad_request(server, "/v1/messages", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, bad_mark]}]})
    assert messages["message"].startswith("messages[0].content[1]: cache_control must be"), messages


def test_startup_lines_agree_with_vllms_and_read_as_the_plugins(servers):
    """The plugin's capacity line quotes vLLM's "KV cache size" figure and says why its own is
    larger (window-local SWA attention holds a request's window only); its lines name the
    plugin's files, not a bare `scheduler.py` that reads as vLLM's; the custom-scheduler warning
    is answered."""
    log = servers["on"].log_text()
    (vllm_tokens,) = re.findall(r"CPU KV cache size: ([\d,]+) tokens", log)
    (capacity,) = [line for line in log.splitlines() if "vllm-mimo: KV capacity:" in line]
    ours = re.search(r"KV capacity: ([\d,]+) tokens, concurrency ([\d.]+)x for 2,048-token requests", capacity)
    assert ours and f"vLLM's 'KV cache size: {vllm_tokens} tokens' counts" in capacity, capacity
    assert int(ours.group(1).replace(",", "")) > int(vllm_tokens.replace(",", "")), capacity
    plugin_lines = [line for line in log.splitlines() if "] vllm-mimo: " in line]
    assert plugin_lines and all("[vllm_mimo/" in line for line in plugin_lines), plugin_lines
    assert "Using custom scheduler class vllm_mimo.engine.scheduler.MimoScheduler" in log
    assert "scheduler MimoScheduler (vLLM's Scheduler: async scheduling is off" in log


def _readme_metrics() -> dict[str, tuple[set[str], str]]:
    """README's metrics table: {series: (its labels besides model_name and engine, when present)}."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = re.findall(r"^\| `(vllm:mimo_\w+)` \|([^|]*)\|([^|]*)\|", readme, re.M)
    assert rows, "README has no metrics table"
    return {name: (set(re.findall(r"`(\w+)`", labels)), present.strip()) for name, labels, present in rows}


def _live_metrics(server: VllmServer) -> dict[str, set[tuple]]:
    """/metrics's vllm:mimo_* samples: {series: {label sets as sorted (name, value) tuples}}."""
    live: dict[str, set[tuple]] = {}
    for name, labels in re.findall(r"^(vllm:mimo_\w+)\{([^}]*)\}", requests.get(server.url + "/metrics", timeout=10).text, re.M):
        live.setdefault(name, set()).add(tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels))))
    return live


def test_readme_documents_every_series_on_metrics_and_its_labels(servers):
    """Both ways: every vllm:mimo_* series on a live /metrics is in README's table with its labels,
    and every series the table says is always there is; every labelled one is present from the
    start, with every value of its label (anchor kinds, pools) at 0 until it counts."""
    from vllm_mimo.kv_cache.node import AnchorKind

    documented, live = _readme_metrics(), _live_metrics(servers["on"])
    for name, samples in live.items():
        assert name in documented, f"{name} is on /metrics but not in README's table"
        for sample in samples:
            assert {label for label, _ in sample} == {"model_name", "engine"} | documented[name][0], (name, sample)
    always = {name for name, (_, present) in documented.items() if present == "always"}
    assert always <= set(live), f"README says always, /metrics lacks: {sorted(always - set(live))}"
    for name in ("vllm:mimo_anchors_kept_total", "vllm:mimo_anchors_evicted_total"):
        assert {dict(s)["kind"] for s in live[name]} == {kind.value for kind in AnchorKind}, name
    assert {dict(s)["pool"] for s in live["vllm:mimo_pool_evicted_blocks_total"]} == {"swa", "full"}


def test_anchor_kinds_tell_chat_anchors_and_pins_apart(servers):
    """The chat APIs' system-prompt and cache_control anchors and the pinned prompt are counted
    under kinds of their own (the tests above sent both kinds of chat request)."""
    server = servers["on"]
    system = [{"role": "system", "content": SHARED_SYSTEM}]
    _chat(server, system + [{"role": "user", "content": [
        {"type": "text", "text": DOCUMENT[:400], "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "Why?"}]}])
    kept = {dict(s)["kind"]: value for s, value in _kind_values(server, "vllm:mimo_anchors_kept_total").items()}
    assert kept["pinned_prompt"] == 1 and kept["system_prompt"] >= 1 and kept["cache_control"] >= 1, kept


def _kind_values(server: VllmServer, name: str) -> dict[tuple, float]:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return {tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels))): float(value)
            for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M)}
