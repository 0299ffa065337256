"""The host tier's data plane (host memory, the copies, the KV connector that moves them):
not built yet. Its index and policy, the host copies on the prefix tree's nodes, are
`vllm_mimo.block_manager.host_tier`, measured in the replay (`eval.replay --engines mimo-host`)."""
