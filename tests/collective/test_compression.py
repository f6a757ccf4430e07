"""Gradient compression on the wire (fast layer)."""
import torch

from sparkring.collective.compression import Compression


def test_fp16_compression_halves_the_wire_and_restores_the_dtype():
    grad = torch.linspace(-3, 3, 101, dtype=torch.float32)
    wire, ctx = Compression.fp16.compress(grad)
    assert wire.dtype == torch.float16
    back = Compression.fp16.decompress(wire, ctx)
    assert back.dtype == torch.float32 and torch.allclose(back, grad, atol=2e-3)
    same, ctx = Compression.none.compress(grad)
    assert Compression.none.decompress(same, ctx) is grad
    ids = torch.arange(5)
    wire, ctx = Compression.fp16.compress(ids)
    assert wire.dtype == torch.int64  # integers are not compressed
