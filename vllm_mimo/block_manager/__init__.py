"""The KV cache for hybrid SWA models, as a library: its contract (`base`), pools, the prefix
tree, anchor placement and eviction order, and the vLLM-facing adapter. It imports nothing of
the plugin outside itself but `config` and `compat`."""
