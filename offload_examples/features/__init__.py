"""Features built on the core: CUDA graph capture, weight streaming, optimizer-state offload."""
