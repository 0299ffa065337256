"""The tiers below the device: the host tier (L2, `host`) and the shared store behind it (L3,
`l3`), each a policy over the prefix tree's nodes; their data planes are `vllm_mimo.offload`."""
