"""The plugin's logger.

It lives under vLLM's `vllm` logger namespace so that it inherits vLLM's handler, format,
`VLLM_LOGGING_LEVEL` and the `(EngineCore pid=...)` process prefix. vLLM's format names the
source file (`[scheduler.py:81]`), which for the plugin's lines would read as vLLM's own
scheduler; its records name the file by its path in the package instead
(`[vllm_mimo/engine/scheduler.py:81]`), and every message starts with `vllm-mimo:`.
"""

import logging
import os

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _PackagePath(logging.Filter):
    """Sets a record's `filename` to its path from the package's parent directory."""

    def filter(self, record: logging.LogRecord) -> bool:
        path = os.path.abspath(record.pathname)
        if path.startswith(_PACKAGE_PARENT + os.sep):
            record.filename = os.path.relpath(path, _PACKAGE_PARENT)
        return True


logger = logging.getLogger("vllm.mimo")
logger.addFilter(_PackagePath())
