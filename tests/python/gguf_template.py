"""Copies a GGUF file with its `tokenizer.chat_template` replaced (a test fixture: the same model under another chat
template). Pure Python (the test venv has no `gguf` package): the header's metadata is read value by value, the chat
template's value rewritten, the tensor infos copied as they are, and the tensor data copied after padding to the
file's alignment (tensor offsets are relative to the data section, so they stay valid). GGUF versions 2 and 3.
"""

import shutil
import struct
from pathlib import Path

# GGUF value types: byte sizes of the fixed-size ones
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _U32 = 8, 9, 4
KEY = "tokenizer.chat_template"


def _skip_value(buf: bytes, at: int, vtype: int) -> int:
    """The offset just past a value of type `vtype` starting at `at`."""
    if vtype in _FIXED:
        return at + _FIXED[vtype]
    if vtype == _STRING:
        (n,) = struct.unpack_from("<Q", buf, at)
        return at + 8 + n
    if vtype == _ARRAY:
        sub, n = struct.unpack_from("<IQ", buf, at)
        at += 12
        if sub in _FIXED:
            return at + n * _FIXED[sub]
        for _ in range(n):
            at = _skip_value(buf, at, sub)
        return at
    raise ValueError(f"unknown GGUF value type {vtype}")


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def with_chat_template(src: Path, dst: Path, template: str) -> None:
    """Writes `dst`: `src` with `tokenizer.chat_template` set to `template` (added when missing)."""
    with open(src, "rb") as f:
        head = f.read(64 << 20)  # the header of a small model (its vocabulary included) fits
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", head, 0)
    assert magic == b"GGUF" and version in (2, 3), (magic, version)
    at = 24
    kvs = []
    alignment = 32
    for _ in range(n_kv):
        start = at
        (klen,) = struct.unpack_from("<Q", head, at)
        key = head[at + 8:at + 8 + klen].decode("utf-8")
        at += 8 + klen
        (vtype,) = struct.unpack_from("<I", head, at)
        end = _skip_value(head, at + 4, vtype)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", head, at + 4)
        if key != KEY:
            kvs.append(head[start:end])
        at = end
    kvs.append(_string(KEY) + struct.pack("<I", _STRING) + _string(template))
    infos_start = at
    for _ in range(n_tensors):
        (nlen,) = struct.unpack_from("<Q", head, at)
        at += 8 + nlen
        (n_dims,) = struct.unpack_from("<I", head, at)
        at += 4 + 8 * n_dims + 4 + 8
    infos = head[infos_start:at]
    data_start = (at + alignment - 1) // alignment * alignment
    out = struct.pack("<4sIQQ", magic, version, n_tensors, len(kvs)) + b"".join(kvs) + infos
    out += b"\0" * ((-len(out)) % alignment)
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(out)
        f.seek(data_start)
        shutil.copyfileobj(f, g, 16 << 20)
