"""The waiting queue as a look-ahead: what queued requests will hit is kept from eviction.

Every `QueueLookahead.EVERY` scheduler steps that find requests waiting, the first
`queue_lookahead_requests` of them (the head last, so that it ends up the most recently used)
have their cached prefixes counted as just used (`KVCache.touch_prefix`): the anchor each hit
would end at now, and its Full path. Under a long queue a request can wait minutes, and without
this the prefix it came for is as old as its previous turn by the time it is admitted. SGLang's
scheduler does the same by default (`SGLANG_ENABLE_WAITING_PREFIX_REFRESH`) for the first 128
waiting requests every 32 passes; the plugin's default is 1024, which on the public trace slice
under its recorded (overloaded) load keeps 1.1-2x the hits 128 keeps (eval/RESULTS.md, issue 42).
"""

from __future__ import annotations

from collections.abc import Collection
from itertools import islice
from typing import Any

from vllm_mimo.kv_cache.contract import KVCache


class QueueLookahead:
    """Touches the prefixes of the first `requests` waiting requests every `EVERY` steps with a
    queue (0 requests: never)."""

    EVERY = 32

    def __init__(self, cache: KVCache, requests: int) -> None:
        self.cache = cache
        self.requests = requests
        self._steps = 0

    def step(self, waiting: Collection[Any]) -> None:
        """A scheduler step with these requests waiting, in queue order."""
        if not self.requests or not waiting:
            return
        due = self._steps % self.EVERY == 0
        self._steps += 1
        if due:  # the queue is read only on the steps that touch it (the scheduler runs every step)
            for request in reversed(list(islice(waiting, self.requests))):
                self.cache.touch_prefix(request)
