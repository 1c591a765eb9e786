"""Protobuf wire encoding/decoding of the tensor-carrying messages, with one copy of each tensor's bytes.

Building a PrefillRequest with the protobuf classes copies every tensor three times before gRPC sees it
(ndarray.tobytes(), into the message, SerializeToString), and reading a response copies the output twice more
(parse, then `.data`). For a 7B prefill chunk those are tens of MB per copy, and large fresh allocations page-fault
(on the 2-core VM this was measured on, a 40 MB copy into new memory took ~100 ms). This module writes the
request's bytes directly from the arrays' buffers (one bytes.join) and reads outputs as views into the response
bytes (zero copies for numpy outputs).

Field numbers and DType values come from the generated descriptors, so they follow the proto. The tests check
every encoder against the protobuf library's parser and every decoder against its serializer.
"""
import functools

import grpc
import numpy as np

from ._errors import AttndError
from ._proto import pb

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _num(message, field):
    return message.DESCRIPTOR.fields_by_name[field].number


# Field numbers.
T_DTYPE, T_SHAPE, T_DATA = _num(pb.Tensor, "dtype"), _num(pb.Tensor, "shape"), _num(pb.Tensor, "data")
T_REGION = _num(pb.Tensor, "region")
R_ID, R_OFFSET, R_BYTES = (_num(pb.RegionRef, f) for f in ("region_id", "offset", "byte_size"))
P_SEQ, P_LAYER, P_Q, P_K, P_V, P_PROMPT_LEN, P_Q_LAYOUT = (
    _num(pb.PrefillRequest, f) for f in ("sequence_id", "layer", "q", "k", "v", "prompt_len", "q_layout"))
P_OUTPUT = _num(pb.PrefillRequest, "output_region")
E_OUTPUT = _num(pb.DecodeEntry, "output_region")
PR_O, PR_LENGTH = _num(pb.PrefillResponse, "o"), _num(pb.PrefillResponse, "length")
E_SEQ, E_Q, E_K, E_V, E_Q_LAYOUT = (_num(pb.DecodeEntry, f) for f in ("sequence_id", "q", "k", "v", "q_layout"))
D_LAYER, D_ENTRIES = _num(pb.DecodeRequest, "layer"), _num(pb.DecodeRequest, "entries")
D_SEQ_IDS, D_Q, D_K, D_V, D_Q_LAYOUT = (_num(pb.DecodeRequest, f) for f in ("sequence_ids", "q", "k", "v",
                                                                            "q_layout"))
DO_O, DO_LENGTH = _num(pb.DecodeOutput, "o"), _num(pb.DecodeOutput, "length")
DR_OUTPUTS, DR_O, DR_LENGTHS = (_num(pb.DecodeResponse, f) for f in ("outputs", "o", "lengths"))
SQ_TAG, SQ_PREFILL, SQ_DECODE = (_num(pb.SessionRequest, f) for f in ("tag", "prefill", "decode"))
SR_TAG, SR_CODE, SR_MESSAGE, SR_PREFILL, SR_DECODE = (_num(pb.SessionResponse, f) for f in
                                                      ("tag", "code", "message", "prefill", "decode"))


@functools.lru_cache(maxsize=4096)  # tags, dims and sizes recur call after call: a hit is ~10x cheaper
def varint(n):
    n = int(n)
    if n < 0:
        n &= (1 << 64) - 1  # int32/int64 negatives: ten bytes of two's complement
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field, wire_type):
    return varint(field << 3 | wire_type)


class Msg:
    """A message being built: a list of byte chunks (headers and array buffers) and their total size."""
    __slots__ = ("parts", "size")

    def __init__(self):
        self.parts, self.size = [], 0

    def raw(self, b):
        self.parts.append(b)
        self.size += len(b)

    def varint_field(self, field, value, always=False):
        if value or always:
            self.raw(_key(field, _VARINT) + varint(value))

    def bytes_field(self, field, data, nbytes=None):
        n = len(data) if nbytes is None else nbytes
        self.raw(_key(field, _LEN) + varint(n))
        self.parts.append(data)
        self.size += n

    def message_field(self, field, sub):
        self.raw(_key(field, _LEN) + varint(sub.size))
        self.parts.extend(sub.parts)
        self.size += sub.size

    def tobytes(self):
        out = b"".join(self.parts)
        assert len(out) == self.size
        return out


class RegionTensor:
    """A tensor in a registered region: its DType and shape, and [offset, offset + nbytes) of region_id."""
    __slots__ = ("dtype", "shape", "region_id", "offset", "nbytes")

    def __init__(self, dtype, shape, region_id, offset, nbytes):
        self.dtype, self.shape, self.region_id = dtype, tuple(shape), region_id
        self.offset, self.nbytes = int(offset), int(nbytes)


def region_ref(region_id, offset, nbytes):
    m = Msg()
    m.bytes_field(R_ID, region_id.encode())
    m.varint_field(R_OFFSET, offset)
    m.varint_field(R_BYTES, nbytes)
    return m


def tensor(array, dtype):
    """A Tensor message over a C-contiguous little-endian numpy array (no copy until tobytes()), or a
    reference when `array` is a RegionTensor."""
    m = Msg()
    if isinstance(array, RegionTensor):
        m.varint_field(T_DTYPE, array.dtype)
        if array.shape:
            packed = b"".join(varint(d) for d in array.shape)
            m.raw(_key(T_SHAPE, _LEN) + varint(len(packed)) + packed)
        m.message_field(T_REGION, region_ref(array.region_id, array.offset, array.nbytes))
        return m
    m.varint_field(T_DTYPE, dtype)
    if array.ndim:
        packed = b"".join(varint(d) for d in array.shape)
        m.raw(_key(T_SHAPE, _LEN) + varint(len(packed)) + packed)
    if array.nbytes:
        m.bytes_field(T_DATA, memoryview(array.reshape(-1).view("u1")), array.nbytes)
    return m


def prefill_request(seq, layer, q, k, v, prompt_len, q_layout=0, output=None):
    """q/k/v: (array or RegionTensor, DType) pairs; q_layout: an attnd.v1.QLayout value; output: a
    RegionTensor where o goes, or None."""
    m = Msg()
    if seq:
        m.bytes_field(P_SEQ, seq.encode())
    m.varint_field(P_LAYER, layer)
    for field, (a, dt) in ((P_Q, q), (P_K, k), (P_V, v)):
        m.message_field(field, tensor(a, dt))
    if prompt_len is not None:
        m.varint_field(P_PROMPT_LEN, prompt_len, always=True)  # proto3 optional: presence is meaningful
    m.varint_field(P_Q_LAYOUT, q_layout)  # 0 (the five variants) is the default: not written
    if output is not None:
        m.message_field(P_OUTPUT, region_ref(output.region_id, output.offset, output.nbytes))
    return m


def decode_request(layer, entries):
    """entries: (seq, (q, dtype), (k, dtype), (v, dtype), q_layout[, output RegionTensor or None]) per
    sequence."""
    m = Msg()
    m.varint_field(D_LAYER, layer)
    for entry in entries:
        seq, q, k, v, q_layout = entry[:5]
        output = entry[5] if len(entry) > 5 else None
        e = Msg()
        if seq:
            e.bytes_field(E_SEQ, seq.encode())
        for field, (a, dt) in ((E_Q, q), (E_K, k), (E_V, v)):
            e.message_field(field, tensor(a, dt))
        e.varint_field(E_Q_LAYOUT, q_layout)
        if output is not None:
            e.message_field(E_OUTPUT, region_ref(output.region_id, output.offset, output.nbytes))
        m.message_field(D_ENTRIES, e)
    return m


def _packed_ids(seqs):
    """The repeated sequence_ids field of B str ids. Equal-length ASCII ids (the server's own) are one
    str.join; others are framed one by one (a few hundred ns each)."""
    n, id_len = len(seqs), len(seqs[0])
    if 0 < id_len < 0x80 and len(set(map(len, seqs))) == 1:
        sep = chr(D_SEQ_IDS << 3 | _LEN) + chr(id_len)
        out = (sep + sep.join(seqs)).encode()
        if len(out) == n * (id_len + 2):  # else an id is not ASCII: more bytes than characters
            return out
    key = _key(D_SEQ_IDS, _LEN)
    return b"".join(key + varint(len(b)) + b for b in (s.encode() for s in seqs))


def decode_request_packed(layer, seqs, q, k, v, q_layout):
    """The packed DecodeRequest (attention.proto): seqs, B str ids; q/k/v: (numpy [B, ...] C-contiguous
    array, DType), one tensor per kind whose buffer is written as it is: the message is a handful of parts
    and tobytes() copies each array once, with no per-sequence work but the ids' framing."""
    m = Msg()
    m.varint_field(D_LAYER, layer)
    m.raw(_packed_ids(seqs))
    for field, (a, dt) in ((D_Q, q), (D_K, k), (D_V, v)):
        m.message_field(field, tensor(a, dt))
    m.varint_field(D_Q_LAYOUT, q_layout)
    return m


def session_request(tag, prefill=None, decode=None):
    m = Msg()
    m.varint_field(SQ_TAG, tag)
    if prefill is not None:
        m.message_field(SQ_PREFILL, prefill)
    if decode is not None:
        m.message_field(SQ_DECODE, decode)
    return m


# ---- decoding ----

def _malformed(what):
    return AttndError(grpc.StatusCode.INTERNAL, "malformed response from the server: " + what)


def _read_varint(buf, pos, end):
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _malformed("bad varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf, pos, end):
    """Yields (field, wire_type, value): an int for varints/fixed, a (start, stop) span for LEN fields."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wt = key >> 3, key & 7
        if wt == _VARINT:
            value, pos = _read_varint(buf, pos, end)
        elif wt == _LEN:
            n, pos = _read_varint(buf, pos, end)
            if pos + n > end:
                raise _malformed("truncated field %d" % field)
            value = (pos, pos + n)
            pos += n
        elif wt == _I64:
            value = int.from_bytes(buf[pos:pos + 8], "little")
            pos += 8
        elif wt == _I32:
            value = int.from_bytes(buf[pos:pos + 4], "little")
            pos += 4
        else:
            raise _malformed("wire type %d" % wt)
        if pos > end:
            raise _malformed("truncated message")
        yield field, wt, value


def _signed64(v):
    return v - (1 << 64) if v >= 1 << 63 else v


class TensorView:
    """A decoded Tensor: dtype, shape, its data as a memoryview into the response bytes, and whether it
    carries a region reference instead (an output written to a region)."""
    __slots__ = ("dtype", "shape", "data", "region")

    def __init__(self, dtype, shape, data, region=False):
        self.dtype, self.shape, self.data, self.region = dtype, shape, data, region


def parse_tensor(mv, start, end):
    dtype, shape, data, region = 0, [], mv[0:0], False
    for field, wt, value in _fields(mv, start, end):
        if field == T_DTYPE and wt == _VARINT:
            dtype = value
        elif field == T_SHAPE and wt == _LEN:  # packed
            p, stop = value
            while p < stop:
                d, p = _read_varint(mv, p, stop)
                shape.append(_signed64(d))
        elif field == T_SHAPE and wt == _VARINT:  # unpacked (also valid proto3 input)
            shape.append(_signed64(value))
        elif field == T_DATA and wt == _LEN:
            data = mv[value[0]:value[1]]
        elif field == T_REGION and wt == _LEN:
            region = True
    return TensorView(dtype, shape, data, region)


def _parse_output(mv, start, end, o_field, length_field):
    t, length = None, 0
    for field, wt, value in _fields(mv, start, end):
        if field == o_field and wt == _LEN:
            t = parse_tensor(mv, *value)
        elif field == length_field and wt == _VARINT:
            length = _signed64(value)
    if t is None:
        t = TensorView(0, [], mv[0:0])
    return t, length


def parse_prefill_response(mv, start=0, end=None):
    """-> (TensorView, length)."""
    return _parse_output(mv, start, len(mv) if end is None else end, PR_O, PR_LENGTH)


def parse_decode_response(mv, start=0, end=None):
    """-> [(TensorView, length)] in request order."""
    end = len(mv) if end is None else end
    outputs = []
    for field, wt, value in _fields(mv, start, end):
        if field == DR_OUTPUTS and wt == _LEN:
            outputs.append(_parse_output(mv, value[0], value[1], DO_O, DO_LENGTH))
    return outputs


_SHIFTS = np.int64(1) << (7 * np.arange(9, dtype=np.int64))


def _packed_varints(buf):
    """The values of a packed repeated int64 field (a run of varints) as an int64 array, decoded with numpy:
    each value ends at a byte below 0x80, and its 7-bit groups are summed at their shifts."""
    b = np.frombuffer(buf, np.uint8)
    if b.size == 0:
        return np.zeros(0, np.int64)
    # Lengths of one batch mostly share a width: then the run is a [B, width] matrix (a third of the work).
    width = int(np.argmax(b < 0x80)) + 1
    if width < 10 and b.size % width == 0:
        rows = b.reshape(-1, width)
        if (rows[:, -1] < 0x80).all() and (rows[:, :-1] >= 0x80).all():
            return (rows & 0x7F).astype(np.int64) @ _SHIFTS[:width]
    ends = np.flatnonzero(b < 0x80)
    if ends.size == 0 or ends[-1] != b.size - 1:
        raise _malformed("bad packed varints")
    starts = np.concatenate(([0], ends[:-1] + 1))
    widths = ends - starts + 1
    if widths.max() > 10:
        raise _malformed("bad varint")
    shift = (np.arange(b.size) - np.repeat(starts, widths)) * 7
    groups = (b & 0x7F).astype(np.uint64) << shift.astype(np.uint64)
    return np.add.reduceat(groups, starts).view(np.int64)


def parse_packed_decode_response(mv, start=0, end=None):
    """-> (TensorView o [B, Hq, D], int64 array of B lengths) for the answer to a packed request, or None when
    the response is of the entries form (DecodeOutputs)."""
    end = len(mv) if end is None else end
    o, lengths = None, []
    for field, wt, value in _fields(mv, start, end):
        if field == DR_OUTPUTS:
            return None
        if field == DR_O and wt == _LEN:
            o = parse_tensor(mv, *value)
        elif field == DR_LENGTHS and wt == _LEN:
            lengths.append(_packed_varints(mv[value[0]:value[1]]))
        elif field == DR_LENGTHS and wt == _VARINT:  # unpacked (also valid proto3 input)
            lengths.append(np.array([_signed64(value)], np.int64))
    if o is None:
        o = TensorView(0, [], mv[0:0])
    return o, (np.concatenate(lengths) if lengths else np.zeros(0, np.int64))


def parse_session_response(mv):
    """-> (tag, code, message, kind ('prefill', 'decode' or None), span (start, stop) of the payload)."""
    tag = code = 0
    message, kind, span = "", None, None
    for field, wt, value in _fields(mv, 0, len(mv)):
        if field == SR_TAG and wt == _VARINT:
            tag = value
        elif field == SR_CODE and wt == _VARINT:
            code = _signed64(value)
        elif field == SR_MESSAGE and wt == _LEN:
            message = bytes(mv[value[0]:value[1]]).decode("utf-8", "replace")
        elif field == SR_PREFILL and wt == _LEN:
            kind, span = "prefill", value
        elif field == SR_DECODE and wt == _LEN:
            kind, span = "decode", value
    return tag, code, message, kind, span
