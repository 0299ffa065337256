"""KV cache management for hybrid SWA models: the scheduler hook (and, next, pools, prefix tree, KV manager)."""
