"""Test and demo support: tiny local models and a `vllm serve` launcher."""
