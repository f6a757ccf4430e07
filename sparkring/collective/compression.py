"""Gradient compression for allreduce: none, fp16 and bf16, with Horovod's interface."""
from __future__ import annotations

from typing import Any, Tuple

import torch
from typing_extensions import override


class Compressor:
    """Interface: ``compress`` returns (tensor to send, context); ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Compress ``tensor`` for the exchange: the tensor sent and what decompress() needs to undo it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The tensor compress() was given, from the one exchanged and ``ctx``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are.

    >>> t, ctx = NoneCompressor.compress(torch.ones(2)); NoneCompressor.decompress(t, ctx)
    tensor([1., 1.])
    """

    @staticmethod
    @override
    def compress(tensor):
        return tensor, None

    @staticmethod
    @override
    def decompress(tensor, ctx):
        return tensor


def _casting(dtype: torch.dtype, name: str, doc: str) -> type:
    """A compressor that sends floating point tensors as ``dtype`` and casts them back after."""

    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != dtype:
            return tensor.to(dtype), tensor.dtype
        return tensor, None

    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx is not None else tensor

    return type(name, (Compressor,), {"__doc__": doc, "__module__": __name__,
                                      "compress": staticmethod(compress), "decompress": staticmethod(decompress)})


FP16Compressor = _casting(torch.float16, "FP16Compressor", """Casts floating point tensors to float16 on the wire, back
    to their dtype after.

    >>> t, ctx = FP16Compressor.compress(torch.ones(2)); t.dtype
    torch.float16
    """)
BF16Compressor = _casting(torch.bfloat16, "BF16Compressor", """Casts floating point tensors to bfloat16 on the wire
    (float32's range, 8 bits of mantissa), back to their dtype after.

    >>> t, ctx = BF16Compressor.compress(torch.ones(2)); t.dtype, BF16Compressor.decompress(t, ctx).dtype
    (torch.bfloat16, torch.float32)
    """)


class Compression:
    """Choices for ``compression=``: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16``.

    >>> opt = DistributedOptimizer(opt, compression=Compression.fp16)  # doctest: +SKIP
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
