"""Host KV tier with mask-only transfers. Empty until that issue lands."""
