"""Protobuf messages on the wire: layout conversion and a copy-free KVChunk codec.

A KVChunk is `header` (field 1) and `data` (field 2). The generic protobuf
path copies the multi-megabyte payload twice per side (into the message and
out again), so Pull encodes and decodes it directly in protobuf wire format:
the sender joins the header with the payload tensors' buffers in one copy,
and the receiver takes the payload as a memoryview of the received bytes.
The bytes are standard protobuf, so any KVChunk parser reads them too.
"""
from __future__ import annotations

from engine.kv_cache import KVLayout
from protos import kv_transfer_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name
_HEADER_KEY = b"\x0a"  # field 1, length-delimited
_DATA_KEY = b"\x12"  # field 2, length-delimited


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(model_id=layout.model_id, dtype=layout.dtype, block_size=layout.block_size,
                       num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim)


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(msg.model_id, msg.dtype, msg.block_size, msg.num_layers, msg.num_kv_heads, msg.head_dim)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or oversized varint in KVChunk")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def encode_chunk(header: pb.ChunkHeader, payload: list[memoryview]) -> bytes:
    """Serialize KVChunk(header, data=concatenated payload) with a single copy of the payload."""
    head = header.SerializeToString()
    size = sum(p.nbytes for p in payload)
    return b"".join([_HEADER_KEY, _varint(len(head)), head, _DATA_KEY, _varint(size), *payload])


def decode_chunk(data: bytes) -> tuple[pb.ChunkHeader, memoryview]:
    """Parse a serialized KVChunk; the payload is a view into `data`, not a copy."""
    buf = memoryview(data)
    header, payload, pos = pb.ChunkHeader(), buf[:0], 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 2:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("truncated KVChunk")
            value, pos = buf[pos:pos + size], pos + size
            if field == 1:
                header.MergeFromString(value)
            elif field == 2:
                payload = value
        elif wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"unsupported wire type {wire_type} in KVChunk")
    return header, payload
