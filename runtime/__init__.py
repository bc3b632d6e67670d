"""Model execution: package loading, the TP model, KV cache, sampling and scheduling."""
