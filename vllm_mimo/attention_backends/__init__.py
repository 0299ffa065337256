"""SWA attention paths (FlashInfer on CUDA, a torch reference on CPU). Empty until that issue lands."""
