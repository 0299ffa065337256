"""Multi-layer MTP warmed in prefill. Empty until that issue lands."""
