"""A reader of gzip'd IDX files (the format of MNIST and Fashion-MNIST), numpy only.

An IDX file is a 4-byte magic number ``0x0000TTNN`` (``TT`` the element type, ``NN`` the
number of dimensions), ``NN`` big-endian uint32 sizes, then the elements in C order,
big-endian. ``read_idx`` checks all of it and raises ``IdxError`` (one line naming the file,
what is wrong and what to do) on a file that is not gzip, not IDX, truncated, longer than
its header says, or whose sha256 is not the expected one.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import zlib

import numpy as np

# IDX element type code -> numpy dtype (big-endian as stored).
IDX_TYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IdxError(ValueError):
  """A file that cannot be read as the expected IDX file; ``str(err)`` is one line."""


def sha256_bytes(raw: bytes) -> str:
  """Hex sha256 of ``raw``."""
  return hashlib.sha256(raw).hexdigest()


def parse_idx(payload: bytes, where: str = "IDX data") -> np.ndarray:
  """Parses uncompressed IDX bytes into a native-endian array of the header's shape.

  ``where`` names the data in error messages (e.g. the file's path).
  """
  if len(payload) < 4:
    raise IdxError(f"{where}: truncated IDX file ({len(payload)} bytes, shorter than the "
                   "4-byte magic number); copy the file again")
  zero, type_code, ndim = int.from_bytes(payload[:2], "big"), payload[2], payload[3]
  if zero != 0 or type_code not in IDX_TYPES or ndim == 0:
    raise IdxError(
        f"{where}: not an IDX file (magic number 0x{payload[:4].hex()}, expected 0x0000TTNN "
        f"with element type TT in {', '.join(f'{t:02x}' for t in IDX_TYPES)} and NN >= 1 "
        "dimensions); pass the original IDX file")
  header = 4 + 4 * ndim
  if len(payload) < header:
    raise IdxError(f"{where}: truncated IDX file ({len(payload)} bytes, shorter than its "
                   f"{header}-byte header); copy the file again")
  dims = tuple(int.from_bytes(payload[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
  dtype = IDX_TYPES[type_code]
  need = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
  have = len(payload) - header
  if have != need:
    what = "truncated IDX file" if have < need else "IDX file longer than its header says"
    raise IdxError(f"{where}: {what} ({have} bytes of data, dims {dims} of {dtype.name} "
                   f"need {need}); copy the file again")
  array = np.frombuffer(payload, dtype=dtype, offset=header).reshape(dims)
  return array.astype(dtype.newbyteorder("="), copy=False)


def read_idx(path: str | os.PathLike, sha256: str | None = None, hint: str = "") -> np.ndarray:
  """Reads a gzip'd IDX file; ``sha256``: the expected hex digest of the ``.gz`` file.

  Returns a native-endian array of the header's dims and type (uint8 for images and
  labels). ``hint`` is appended to a checksum error (how to get the original file).

  Raises:
    IdxError: not gzip, not IDX, truncated, too long, or a checksum that differs.
    OSError: the file cannot be opened.
  """
  path = os.fspath(path)
  with open(path, "rb") as f:
    raw = f.read()
  if sha256 is not None:
    got = sha256_bytes(raw)
    if got != sha256.lower():
      raise IdxError(f"{path}: sha256 {got} differs from the original file's {sha256} (a "
                     f"different, modified or incomplete file){'; ' + hint if hint else ''}")
  try:
    payload = gzip.decompress(raw)
  except EOFError:
    raise IdxError(f"{path}: truncated gzip file (it ends before the end of its compressed "
                   "stream); copy the file again") from None
  except (gzip.BadGzipFile, zlib.error) as err:
    raise IdxError(f"{path}: not a readable gzip file ({err}); pass the original "
                   "gzip'd IDX file") from None
  return parse_idx(payload, path)
