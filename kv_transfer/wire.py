"""KvPushMessage bytes without copying chunk data: the header goes through protobuf, the
data field is appended (sender) or sliced out (receiver) as raw bytes.

Protobuf fields may come in any order and a message may be split or repeated, so a
message this fast path does not recognise is parsed the ordinary way.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import DecodeError

from tandem.v1 import kv_transfer_pb2 as pb

_CHUNK_FIELD = pb.KvPushMessage.DESCRIPTOR.fields_by_name["chunk"].number
_DATA_FIELD = pb.KvChunk.DESCRIPTOR.fields_by_name["data"].number
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_EMPTY = memoryview(b"")


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_CHUNK_KEY = _varint(_CHUNK_FIELD << 3 | _LENGTH_DELIMITED)
_DATA_KEY = _varint(_DATA_FIELD << 3 | _LENGTH_DELIMITED)


def encode_chunk_message(header: pb.KvChunk, data: memoryview) -> bytes:
    """KvPushMessage{chunk: header with data} serialized, copying ``data`` once."""
    head = header.SerializeToString()
    data_length = _varint(len(data))
    chunk_length = len(head) + len(_DATA_KEY) + len(data_length) + len(data)
    return b"".join((_CHUNK_KEY, _varint(chunk_length), head, _DATA_KEY, data_length, data))


def split_push_message(raw: bytes) -> tuple[pb.KvPushMessage, memoryview]:
    """The message without its chunk data, and the data as a view of ``raw``.

    Raises ValueError on bytes that are not a KvPushMessage.
    """
    try:
        fields = list(_fields(raw, 0, len(raw)))
        if len(fields) == 1 and fields[0][:2] == (_CHUNK_FIELD, _LENGTH_DELIMITED):
            _, _, _, start, end = fields[0]
            header, span = [], (0, 0)
            for number, wire_type, field_start, value_start, value_end in _fields(raw, start, end):
                if (number, wire_type) == (_DATA_FIELD, _LENGTH_DELIMITED):
                    span = (value_start, value_end)  # the last one wins, as in protobuf
                else:
                    header.append(raw[field_start:value_end])
            chunk = pb.KvChunk.FromString(b"".join(header))
            return pb.KvPushMessage(chunk=chunk), memoryview(raw)[span[0] : span[1]]
        message = pb.KvPushMessage.FromString(raw)
    except DecodeError as e:
        raise ValueError(f"not a KvPushMessage: {e}") from e
    if not message.HasField("chunk") or not message.chunk.data:
        return message, _EMPTY
    data = message.chunk.data
    message.chunk.ClearField("data")
    return message, memoryview(data)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while shift < 64:
        if pos >= len(buf):
            raise ValueError("not a KvPushMessage: truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise ValueError("not a KvPushMessage: varint over 64 bits")


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(number, wire type, field start, value start, value end) of each field."""
    while pos < end:
        field_start = pos
        key, pos = _read_varint(buf, pos)
        wire_type = key & 7
        value_start = pos
        if wire_type == _VARINT:
            _, pos = _read_varint(buf, pos)
        elif wire_type == _FIXED64:
            pos += 8
        elif wire_type == _FIXED32:
            pos += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, value_start = _read_varint(buf, pos)
            pos = value_start + length
        else:
            raise ValueError(f"not a KvPushMessage: wire type {wire_type}")
        if pos > end:
            raise ValueError("not a KvPushMessage: truncated field")
        yield key >> 3, wire_type, field_start, value_start, pos
