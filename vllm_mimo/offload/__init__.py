"""The host tier's data plane: host memory, the copies, and the KV connector that moves them
(`connector.MimoHostTierConnector`). Its index and policy, the host copies on the prefix tree's
nodes, are `vllm_mimo.kv_cache.tiers.host`; the import arrow points from here to there.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_mimo.config import MimoConfig, MimoConfigError

CONNECTOR = "MimoHostTierConnector"
CONNECTOR_MODULE = "vllm_mimo.offload.connector"


def machine_memory_gib() -> float:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)


def check_host_memory(host_tier_gib: float, l3_gib: float = 0.0) -> None:
    """The host tier and this instance's part of the L3 (`l3_gib`, host memory Mooncake keeps
    too) must fit in this machine's memory together."""
    total = machine_memory_gib()
    if host_tier_gib > total:
        raise MimoConfigError(
            f"host_tier_gib={host_tier_gib:g} is more than this machine's memory ({total:.1f} GiB); "
            f"allowed: 0 <= host_tier_gib <= {total:.1f} (0 turns the host tier off)"
        )
    if host_tier_gib + l3_gib > total:
        raise MimoConfigError(
            f"host_tier_gib={host_tier_gib:g} plus l3_gib={l3_gib:g} ({host_tier_gib + l3_gib:g} GiB of host "
            f"memory) is more than this machine's memory ({total:.1f} GiB); allowed: host_tier_gib + l3_gib "
            f"<= {total:.1f}"
        )


def configure(vllm_config: Any, config: MimoConfig) -> None:
    """With `host_tier_gib > 0` (checked by `check_host_memory`): install the plugin's KV
    connector in the config (refused if prefix caching is off; another connector is refused
    before, for every hybrid model, by `refuse_other_connector`)."""
    if not config.host_tier_gib:
        return
    from vllm_mimo.compat import KVTransferConfig

    transfer = vllm_config.kv_transfer_config
    if transfer is not None and transfer.kv_connector == CONNECTOR:
        return  # a config rebuilt from one this hook already configured
    if not vllm_config.cache_config.enable_prefix_caching:
        raise MimoConfigError(
            f"host_tier_gib={config.host_tier_gib:g} needs prefix caching, which is off "
            "(drop --no-enable-prefix-caching or set host_tier_gib to 0)"
        )
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        # A load that fails makes its request recompute (vLLM's default fails the request).
        kv_load_failure_policy="recompute",
    )


def refuse_other_connector(vllm_config: Any) -> None:
    """The plugin's KV manager takes external KV only from its own connector (the host tier);
    with any other KV connector (`--kv-transfer-config`, vLLM's `--kv-offloading-size`, LMCache,
    P/D connectors) it would have to leave vLLM's manager in place and every plugin feature off,
    so startup stops instead, naming the connector and the two ways on: the plugin off for this
    model, or the plugin's own host tier in place of vLLM's CPU offloading. vLLM's MultiConnector
    does not change this, even with the plugin's connector first: it binds every child to the
    same KV manager and lets the first child that reports a hit load it, but this manager reads
    every external token as its host tier's (`HybridKVCacheManager.allocate_slots`), so another
    child's load would be taken for a host-tier load."""
    transfer = vllm_config.kv_transfer_config
    name = None if transfer is None else transfer.kv_connector
    if name is None or name == CONNECTOR:
        return
    offloading = vllm_config.cache_config.kv_offloading_size
    hint = (
        f" (set by --kv-offloading-size {offloading:g}: the plugin's host tier does that job, "
        f"--additional-config '{{\"mimo\": {{\"host_tier_gib\": {offloading:g}}}}}' instead)"
        if offloading is not None
        else ""
    )
    raise MimoConfigError(
        f"the KV connector {name}{hint} cannot run beside the plugin's KV manager, which takes KV from no "
        f"other connector; to keep {name}, turn the plugin off for this model with "
        f"--additional-config '{{\"mimo\": {{\"enable\": false}}}}' (vLLM's own KV manager and every "
        "connector then work as without the plugin)"
    )
