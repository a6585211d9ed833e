"""fp8 destinations for :mod:`reshard.torch`, one module per part.

- :mod:`.inflight`: quantizing in flight (``reshard_(..., quant=...)``);
- :mod:`.prequantized`: already-quantized tensors moved with their scales (``src_scale=``);
- :mod:`.ops`: the quantizer as torch operations, bit for bit the Rust kernels' output.
"""
