"""What runs inside vLLM's processes: the scheduler with the plugin's KV cache, the step cut,
pinned prompts, metrics publishing, and anchors from the chat APIs."""
