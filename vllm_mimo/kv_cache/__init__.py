"""The KV cache for hybrid SWA models, as a library: its contract (`contract`), pools, the
prefix tree, anchors and the anchor policy, the allocation path, and the tiers below the device
(`tiers`). vLLM's scheduler reaches it through `vllm_mimo.engine.kv_manager`."""
