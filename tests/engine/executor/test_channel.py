"""The step channel's ring (engine/executor/channel.py), one writer and several readers on
threads of this process: messages of every size arrive whole and in order (empty ones,
exact multiples of a slot, longer than the whole ring), the writer waits for the slowest
reader, a message cut off mid-way is refused, and a reader whose parent is gone leaves."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.executor.channel import RankGone, StepChannel

SLOT_BYTES, NUM_SLOTS = 64, 3


def no_check() -> None:
    pass


def open_ring(num_readers: int, timeout_s: float = 10.0) -> tuple[StepChannel, list[StepChannel]]:
    writer, fd = StepChannel.create(
        num_readers, slot_bytes=SLOT_BYTES, num_slots=NUM_SLOTS, timeout_s=timeout_s
    )
    readers = [
        StepChannel.attach(
            os.getpid(),
            fd,
            num_readers,
            r,
            slot_bytes=SLOT_BYTES,
            num_slots=NUM_SLOTS,
            timeout_s=timeout_s,
        )
        for r in range(num_readers)
    ]
    return writer, readers


def test_messages_of_every_size_arrive_whole_and_in_order_at_every_reader() -> None:
    sizes = [0, 1, 7, SLOT_BYTES, SLOT_BYTES - 8, 2 * SLOT_BYTES, SLOT_BYTES * NUM_SLOTS * 3 + 5]
    messages = [torch.arange(n, dtype=torch.uint8) for n in sizes] * 3
    writer, readers = open_ring(3)
    got: list[list[torch.Tensor]] = [[] for _ in readers]

    def read(r: int) -> None:
        for _ in messages:
            got[r].append(readers[r].receive(os.getppid()))

    threads = [threading.Thread(target=read, args=(r,)) for r in range(len(readers))]
    for t in threads:
        t.start()
    for m in messages:  # the ring holds 3 slots: the writer waits for the slowest reader
        writer.send(m, no_check)
    for t in threads:
        t.join(timeout=30)
    for r in range(len(readers)):
        assert [g.tolist() for g in got[r]] == [m.tolist() for m in messages]
    for c in [writer, *readers]:
        c.close()


def test_a_message_cut_off_mid_way_is_refused() -> None:
    writer, (reader,) = open_ring(1)
    long = torch.ones(3 * SLOT_BYTES, dtype=torch.uint8)
    writer._messages += 1  # as a send interrupted after its first piece left would be
    first = writer._slots[writer._count % NUM_SLOTS]
    first[:32].view(torch.int64).copy_(torch.tensor([writer._messages, long.numel(), 0, 64]))
    writer._count += 1
    writer._written[0] = writer._count
    writer.send(torch.zeros(8, dtype=torch.uint8), no_check)  # the next message
    with pytest.raises(RuntimeError, match="message 1 was cut off at byte 64"):
        reader.receive(os.getppid())
    writer.close()
    reader.close()


def test_a_writer_waits_for_a_reader_no_longer_than_its_timeout() -> None:
    writer, readers = open_ring(1, timeout_s=0.3)
    for _ in range(NUM_SLOTS):
        writer.send(torch.zeros(8, dtype=torch.uint8), no_check)
    with pytest.raises(RuntimeError, match=r"did not read its step inputs within 0\.3 s"):
        writer.send(torch.zeros(8, dtype=torch.uint8), no_check)
    checked: list[int] = []

    def lost() -> None:
        checked.append(1)
        raise RuntimeError("rank 1 ended")

    with pytest.raises(RuntimeError, match="rank 1 ended"):  # asked while it waits
        writer.send(torch.zeros(8, dtype=torch.uint8), lost)
    assert checked == [1]
    for c in [writer, *readers]:
        c.close()


def test_a_reader_leaves_when_its_parent_is_gone() -> None:
    writer, (reader,) = open_ring(1)
    with pytest.raises(RankGone, match=r"rank 0 \(pid \d+\) is gone"):
        reader.receive(os.getppid() + 1_000_000)  # not this process's parent
    writer.close()
    reader.close()
