"""vllm-mimo: serve hybrid sliding-window-attention models the way the MiMo-V2.5 report says.

vLLM loads `register` from the `vllm.general_plugins` entry point in every process.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point: idempotent, cheap, and a no-op when disabled."""
    from vllm_mimo import hooks

    hooks.install()
