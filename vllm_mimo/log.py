"""The plugin's logger.

It lives under vLLM's `vllm` logger namespace so that it inherits vLLM's handler, format,
`VLLM_LOGGING_LEVEL` and the `(EngineCore pid=...)` process prefix.
"""

import logging

logger = logging.getLogger("vllm.mimo")
