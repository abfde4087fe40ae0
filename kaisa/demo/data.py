"""Fashion-MNIST from the standard IDX gzip files, validated on the way in.

The four files (``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``) are read as they
are distributed (Debian's ``dataset-fashion-mnist`` installs them in
``/usr/share/datasets/fashion-mnist``). Every problem with them (a missing file,
a truncated or non-gzip file, a wrong magic number, sizes that disagree, labels
out of range) raises :class:`DatasetError` with a message that names the file.

The IDX format: a big-endian header ``0x00 0x00 <type> <ndim>`` (type ``0x08``
is unsigned byte), then ``ndim`` big-endian 32-bit sizes, then the data in
C order.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

__all__ = [
    "DEFAULT_DATA_DIR",
    "FILES",
    "DatasetError",
    "FashionMNIST",
    "load_fashion_mnist",
    "read_idx",
    "write_idx",
]

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
"""Where Debian's ``dataset-fashion-mnist`` package installs the files."""

FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
"""The four standard file names, by role."""

NUM_CLASSES = 10
# Mean and standard deviation of the Fashion-MNIST training pixels in [0, 1].
_MEAN = 0.2860
_STD = 0.3530
_UBYTE = 0x08
#: At most this many data bytes (Fashion-MNIST's largest file holds 47 million).
_MAX_ELEMENTS = 1 << 27


class DatasetError(Exception):
    """A dataset file is missing, unreadable or not what it should be."""


def read_idx(path: str | os.PathLike[str], ndim: int) -> npt.NDArray[np.uint8]:
    """Read one gzip-compressed IDX file of unsigned bytes with ``ndim`` dimensions.

    Raises :class:`DatasetError` when the file is missing, is not gzip, is
    truncated, has a wrong magic number or dimension count, or holds a number
    of bytes that does not match its header.
    """
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p}: file not found")
    try:
        # The header first, then exactly the bytes it announces (and one more to
        # detect trailing data): a file that decompresses to far more than its
        # header says (a gzip bomb) is refused after reading at most that much.
        with gzip.open(p, "rb") as f:
            shape, header_error = _read_header(f, ndim)
            if header_error:
                raise DatasetError(f"{p}: {header_error}")
            count = 1
            for size in shape:
                count *= size
            if count == 0 or count > _MAX_ELEMENTS:
                raise DatasetError(f"{p}: implausible IDX shape {tuple(shape)}")
            data = f.read(count)
            trailing = f.read(1)
    except (OSError, EOFError, zlib.error) as exc:
        # gzip.BadGzipFile is an OSError; a truncated stream is an EOFError.
        raise DatasetError(f"{p}: not a readable gzip file ({exc})") from None
    if len(data) != count or trailing:
        held = f"{len(data)}" if not trailing else f"more than {count}"
        raise DatasetError(
            f"{p}: header says {tuple(shape)} = {count} bytes of data, file holds {held}"
        )
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _read_header(f: gzip.GzipFile, ndim: int) -> tuple[tuple[int, ...], str]:
    """The IDX header's shape, or an error message (``''`` when it is good)."""
    magic_bytes = f.read(4)
    if len(magic_bytes) < 4:
        return (), f"too short for an IDX header ({len(magic_bytes)} bytes)"
    zero, dtype, dims = struct.unpack(">HBB", magic_bytes)
    if zero != 0 or dtype != _UBYTE or dims != ndim:
        magic = int.from_bytes(magic_bytes, "big")
        expected = (_UBYTE << 8) | ndim
        return (), (
            f"bad IDX magic number 0x{magic:08x} (expected 0x{expected:08x}: "
            f"unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''})"
        )
    sizes = f.read(4 * ndim)
    if len(sizes) < 4 * ndim:
        return (), "truncated IDX header"
    return struct.unpack(">" + "I" * ndim, sizes), ""


def write_idx(path: str | os.PathLike[str], array: npt.NDArray[np.uint8]) -> None:
    """Write ``array`` (unsigned bytes) as a gzip-compressed IDX file.

    Used by the tests to make small data sets in the real format.
    """
    arr = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, _UBYTE, arr.ndim)
    header += struct.pack(">" + "I" * arr.ndim, *arr.shape)
    with gzip.open(Path(path), "wb") as f:
        f.write(header + arr.tobytes())


@dataclass(frozen=True)
class FashionMNIST:
    """The four tensors, normalised: images ``(N, 1, H, W)`` float32, labels int64."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    directory: str

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(channels, height, width)`` of one image."""
        c, h, w = self.train_x.shape[1:]
        return int(c), int(h), int(w)


def _images(path: Path) -> Tensor:
    arr = read_idx(path, ndim=3)
    x = torch.from_numpy(arr.astype(np.float32)).unsqueeze(1)
    return (x / 255.0 - _MEAN) / _STD


def _labels(path: Path, expected: int) -> Tensor:
    arr = read_idx(path, ndim=1)
    if arr.shape[0] != expected:
        raise DatasetError(
            f"{path}: {arr.shape[0]} labels for {expected} images in the matching image file"
        )
    top = int(arr.max())
    if top >= NUM_CLASSES:
        raise DatasetError(f"{path}: label {top} out of range 0..{NUM_CLASSES - 1}")
    return torch.from_numpy(arr.astype(np.int64))


def load_fashion_mnist(directory: str | os.PathLike[str] = DEFAULT_DATA_DIR) -> FashionMNIST:
    """Load and validate the four files in ``directory``.

    Images are scaled to ``[0, 1]`` and normalised with the training set's mean
    and standard deviation. Raises :class:`DatasetError` on any problem.
    """
    d = Path(directory)
    if not d.is_dir():
        raise DatasetError(f"{d}: dataset directory not found")
    missing = [name for name in FILES.values() if not (d / name).is_file()]
    if missing:
        raise DatasetError(f"{d}: missing {', '.join(missing)}")
    train_x = _images(d / FILES["train_images"])
    test_x = _images(d / FILES["test_images"])
    if train_x.shape[1:] != test_x.shape[1:]:
        raise DatasetError(
            f"{d}: training images are {tuple(train_x.shape[2:])}, "
            f"test images {tuple(test_x.shape[2:])}"
        )
    train_y = _labels(d / FILES["train_labels"], train_x.shape[0])
    test_y = _labels(d / FILES["test_labels"], test_x.shape[0])
    return FashionMNIST(train_x, train_y, test_x, test_y, str(d))
