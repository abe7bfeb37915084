"""CHECKSUM_KIND_SUM64, the checksum a CUDA IPC push computes where the bytes lie: equal
to a plain Python reference (wrapping modulo 2^64) in one shot, piece by piece over
pieces that split words, and over a tensor's bytes; order-sensitive; pushes into shared
pools with it are checked as with the others (test_kv_shared_pools)."""

from __future__ import annotations

import itertools
import random
import struct

import pytest
import torch

from kv_transfer.checksum import Sum64, checksum_function, checksum_kind, running_checksum, sum64
from tandem.v1 import kv_transfer_pb2 as pb


def reference(data: bytes) -> int:
    data = data + b"\0" * (-len(data) % 8)  # padded to whole words
    words = struct.unpack(f"<{len(data) // 8}Q", data)
    return sum((2 * i + 1) * w for i, w in enumerate(words)) % 2**64


@pytest.fixture
def data() -> bytes:
    rng = random.Random(3)
    raw = bytearray(rng.getrandbits(8) for _ in range(8 * 1000))
    raw[:16] = b"\xff" * 16  # words whose products overflow int64 many times over
    return bytes(raw)


def test_one_shot_pieces_and_tensors_equal_the_reference(data: bytes) -> None:
    expected = reference(data)
    assert sum64(data) == expected == checksum_function(pb.CHECKSUM_KIND_SUM64)(data)
    running = running_checksum(checksum_kind("sum64"))
    cuts = [0, 3, 8, 13, 800, 805, 4096, len(data)]  # pieces that split words
    for start, end in itertools.pairwise(cuts):
        running.update(memoryview(data)[start:end])
    assert running.intdigest() == expected
    by_tensor = Sum64()
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    by_tensor.update_tensor(tensor[:4000])
    by_tensor.update_tensor(tensor[4000:].view(torch.int32))  # any dtype's bytes
    assert by_tensor.intdigest() == expected


def test_swapped_words_and_a_flipped_bit_change_it(data: bytes) -> None:
    swapped = data[:16] + data[24:32] + data[16:24] + data[32:]
    assert data[16:24] != data[24:32] and sum64(swapped) != sum64(data)
    for byte, bit in ((4321, 0x10), (7, 0x80), (15, 0x80)):  # bit 63 of words 0 and 1 too
        flipped = bytearray(data)
        flipped[byte] ^= bit
        assert sum64(bytes(flipped)) != sum64(data)


def test_a_partial_last_word_is_padded_and_tensors_take_whole_words() -> None:
    assert sum64(b"\x01" * 11) == reference(b"\x01" * 11) != sum64(b"\x01" * 12)
    running = Sum64()
    with pytest.raises(ValueError, match="not whole 64-bit words"):
        running.update_tensor(torch.zeros(5, dtype=torch.uint8))
    running.update(b"\x01" * 3)
    with pytest.raises(ValueError, match="after a partial word"):
        running.update_tensor(torch.zeros(8, dtype=torch.uint8))
    assert checksum_kind("auto") != pb.CHECKSUM_KIND_SUM64  # never chosen for the host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the device's sums")
def test_a_gpus_sums_equal_the_hosts(data: bytes) -> None:
    """Pieces summed on the GPU (added up there, read once) equal the reference."""
    on_gpu = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
    running = Sum64()
    for start, end in itertools.pairwise([0, 800, 4096, len(data)]):
        running.update_tensor(on_gpu[start:end])
    assert running.intdigest() == reference(data)
