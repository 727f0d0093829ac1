"""CRC-32C of tensors and byte buffers, through the Rust extension (hardware CRC instructions, no GIL)."""

from __future__ import annotations

import torch

from .. import _zswap


def crc32c(data: torch.Tensor | bytes | bytearray | memoryview, seed: int = 0) -> int:
    """CRC-32C of ``data``'s bytes (a contiguous CPU tensor, or a bytes-like object), continuing from
    ``seed`` (the CRC of the bytes before them; 0 to start)."""
    if not isinstance(data, torch.Tensor):
        raw = memoryview(data).cast("B")
        if raw.nbytes == 0:
            return seed
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # small inputs only: state files, configs
    if data.device.type != "cpu" or not data.is_contiguous():
        raise ValueError("crc32c needs a contiguous CPU tensor")
    # `data` stays referenced by this frame for the whole synchronous call.
    return _zswap.crc32c(data.data_ptr(), data.numel() * data.element_size(), seed)


class BlockCrc:
    """CRC-32C of a byte stream fed in pieces: of the whole, and of each `block_size` block of it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.whole = 0
        self.blocks: list[int] = []
        self._block = 0
        self._filled = 0

    def update(self, raw: torch.Tensor) -> None:
        """Feed the next bytes (a contiguous uint8 CPU tensor)."""
        self.whole = crc32c(raw, self.whole)
        pos = 0
        n = raw.numel()
        while pos < n:
            take = min(n - pos, self.block_size - self._filled)
            self._block = crc32c(raw[pos : pos + take], self._block)
            self._filled += take
            pos += take
            if self._filled == self.block_size:
                self.blocks.append(self._block)
                self._block, self._filled = 0, 0

    def finish(self) -> tuple[int, list[int]]:
        """(whole CRC, CRC of each block; the last one may be short)."""
        if self._filled:
            self.blocks.append(self._block)
            self._block, self._filled = 0, 0
        return self.whole, self.blocks
