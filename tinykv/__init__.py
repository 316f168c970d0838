"""tinykv: a minimal decoder whose KV cache is paged, quantized, calibrated and offloadable."""

__version__ = "0.1.0"
