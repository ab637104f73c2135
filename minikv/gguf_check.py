"""A GGUF file's header checked against the file's size before anything trusts it.

GGUF (llama.cpp's format, versions 2 and 3) is a header followed by tensor data:

    magic "GGUF", version u32, tensor_count u64, kv_count u64
    kv_count x   (key: string, value type: u32, value)     strings are a u64 length + UTF-8 bytes;
                                                            arrays an item type u32 + a count u64 + items
    tensor_count x (name: string, n_dims: u32, dims: u64 x n_dims, type: u32, offset: u64)
    padding to `general.alignment` (32 by default), then the tensors' data at their offsets

The `gguf` package's reader believes every count and length it reads: a 60-byte file declaring
an array of 2^62 items makes it allocate until the process is killed. llama.cpp's own reader
refuses such a file by checking each count against the bytes left, and so does `check_gguf`
here, with plain `struct` reads of a memory-mapped file: every string length, array count, KV
count, tensor count and tensor extent (offset + size for its type and shape) must fit in the file.
A file that passes is then safe to hand to `gguf.GGUFReader`.
"""
from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)
# value type -> bytes of one value (GGUFValueType): u8 i8 u16 i16 u32 i32 f32 bool . . u64 i64 f64
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
MIN_VALUE_SIZE = {STRING: 8, ARRAY: 12}  # the length / (item type, count) prefix of an empty one
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays exist in the format; deeper nesting is no model's metadata
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    tensor_count: int
    kv_count: int
    alignment: int
    data_offset: int  # where tensor data starts: the offsets in the tensor index count from here
    sha256: str  # of every byte before data_offset: the metadata and the tensor index


class _Cursor:
    """Reads little- (or big-) endian values from a buffer, refusing to read past its end."""

    def __init__(self, buf, path: Path, order: str):
        self.buf, self.path, self.order, self.pos = buf, path, order, 0

    def error(self, field: str, detail: str) -> ValueError:
        return ValueError(f"{self.path}: GGUF {field}: {detail} (corrupt or truncated file)")

    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, n: int, field: str) -> None:
        if n > self.left():
            raise self.error(field, f"needs {n} bytes at offset {self.pos}, the file has {self.left()} left")

    def unpack(self, fmt: str, field: str):
        size = struct.calcsize(fmt)
        self.need(size, field)
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def u32(self, field: str) -> int:
        return self.unpack("I", field)

    def u64(self, field: str) -> int:
        return self.unpack("Q", field)

    def string(self, field: str) -> str:
        n = self.u64(f"{field} length")
        self.need(n, f"{field} (a string of {n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(field, "is not UTF-8") from None

    def skip_strings(self, n: int, field: str) -> None:
        """Skip n strings (u64 length + bytes each), each checked to end inside the file."""
        length_at, pos, end = struct.Struct(self.order + "Q").unpack_from, self.pos, len(self.buf)
        for i in range(n):
            if pos + 8 > end or pos + 8 + length_at(self.buf, pos)[0] > end:
                self.pos = pos
                raise self.error(f"{field}[{i}]", f"a string running past the file's end at offset {pos}")
            pos += 8 + length_at(self.buf, pos)[0]
        self.pos = pos

    def count(self, field: str, item_size: int) -> int:
        """A u64 count of items of at least item_size bytes each, checked against the bytes left."""
        n = self.u64(field)
        if n * item_size > self.left():
            raise self.error(field, f"declares {n} items of at least {item_size} bytes, "
                                    f"the file has {self.left()} bytes left")
        return n

    def skip_value(self, vtype: int, field: str, depth: int = 0) -> None:
        if vtype in SCALAR_SIZES:
            self.need(SCALAR_SIZES[vtype], field)
            self.pos += SCALAR_SIZES[vtype]
        elif vtype == STRING:
            self.string(field)
        elif vtype == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.error(field, f"arrays nested deeper than {MAX_ARRAY_DEPTH}")
            item = self.u32(f"{field} item type")
            if item in SCALAR_SIZES:  # fixed-size items: check the whole extent, skip it
                n = self.count(f"{field} array count", SCALAR_SIZES[item])
                self.pos += n * SCALAR_SIZES[item]
                return
            if item == STRING:  # a vocabulary: 10^5 strings, walked in one tight loop
                self.skip_strings(self.count(f"{field} array count", 8), field)
                return
            if item != ARRAY:
                raise self.error(f"{field} item type", f"unknown value type {item}")
            for i in range(self.count(f"{field} array count", MIN_VALUE_SIZE[item])):
                self.skip_value(item, f"{field}[{i}]", depth + 1)
        else:
            raise self.error(f"{field} type", f"unknown value type {vtype}")


def check_gguf(path: str | Path) -> GGUFHeader:
    """Check a GGUF file's header against its size; ValueError naming the file and the field
    otherwise. Reads only the header (memory-mapped), so it costs the same for any model size."""
    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{path}: not a GGUF file: {size} bytes, shorter than a GGUF header (24)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != MAGIC:
                raise ValueError(f"{path}: not a GGUF file: it starts with {bytes(buf[:4])!r}, not b'GGUF'")
            # a file written on a big-endian machine reads as version 2^24 or 2^25 here
            order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
            cursor = _Cursor(buf, path, order)
            cursor.pos = 4
            return _check_header(cursor, size)


def _check_header(c: _Cursor, size: int) -> GGUFHeader:
    version = c.u32("version")
    if version not in VERSIONS:
        raise c.error("version", f"{version}, minikv reads GGUF versions {VERSIONS}")
    # a tensor info takes at least 32 bytes (empty name, one dim), a KV at least 13 (empty key, a u8)
    tensor_count = c.count("tensor_count", 32)
    kv_count = c.count("kv_count", 13)
    alignment = DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = c.string(f"kv[{i}] key")
        vtype = c.u32(f"{key!r} value type")
        if key == "general.alignment":
            if vtype != UINT32:
                raise c.error(key, f"value type {vtype}, expected uint32 (4)")
            alignment = c.u32(key)
            if alignment == 0 or alignment & (alignment - 1):
                raise c.error(key, f"{alignment} is not a power of two")
        else:
            c.skip_value(vtype, repr(key))
    tensors = [_tensor_info(c, i) for i in range(tensor_count)]
    names = [t[0] for t in tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise c.error(f"tensor {dup!r}", "named twice in the tensor index")
    data_offset = c.pos + (-c.pos % alignment)
    for name, nbytes, offset in tensors:
        if offset % alignment:
            raise c.error(f"tensor {name!r} offset", f"{offset} is not a multiple of the alignment {alignment}")
        if data_offset + offset + nbytes > size:
            raise c.error(f"tensor {name!r} extent", f"{nbytes} bytes at data offset {offset} end past the "
                                                     f"file's end ({size - data_offset} bytes of data)")
    return GGUFHeader(version, tensor_count, kv_count, alignment, data_offset,
                      hashlib.sha256(c.buf[:c.pos]).hexdigest())


def _tensor_info(c: _Cursor, i: int) -> tuple[str, int, int]:
    """One entry of the tensor index -> (name, bytes of its data, offset), checked for sense."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = c.string(f"tensor[{i}] name")
    n_dims = c.u32(f"tensor {name!r} n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise c.error(f"tensor {name!r} n_dims", f"{n_dims}, expected 1 to {MAX_DIMS}")
    dims = [c.u64(f"tensor {name!r} dims[{d}]") for d in range(n_dims)]
    kind = c.u32(f"tensor {name!r} type")
    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise c.error(f"tensor {name!r} type", f"unknown tensor type {kind}") from None
    if dims[0] % block:
        raise c.error(f"tensor {name!r} dims", f"{dims}: the first must be a multiple of {block} for type {kind}")
    n = 1
    for d in dims:  # Python integers: no overflow, however large the claimed dims
        n *= d
    offset = c.u64(f"tensor {name!r} offset")
    return name, n // block * block_bytes, offset
