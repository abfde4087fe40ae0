"""Real English text for the language-model workload: Debian's ``fortunes`` package, as bytes.

The package ``fortunes`` (``apt-get install -y fortunes``; with its
dependency ``fortunes-min``) installs about 2.6 MB of quotations, jokes and
literature excerpts as plain UTF-8 text files in ``/usr/share/games/fortunes``
(one file per topic: ``art``, ``computers``, ``literature``, ...), each next
to a binary index ``NAME.dat`` and a symbolic link ``NAME.u8``; only the text
files are read. Within a file, lines holding just ``%`` separate the records
(one quotation each).

:func:`load_text_corpus` reads every text file of the directory in sorted
order, splits it into records, and assigns each record to the training or
the validation stream by a stable hash of its bytes (SHA-256; about
:data:`VALIDATION_PERCENT` percent to validation), so the split is the same
on every machine and run, and a record that appears in two files lands on
the same side both times. Each stream is the concatenation of its records,
each followed by a ``%`` line as in the files, as raw UTF-8 bytes: the
model's vocabulary is the 256 byte values.

Training batches are ``B`` windows of ``T + 1`` consecutive bytes at uniform
random offsets of the training stream (:meth:`TextCorpus.sample_batch`, drawn
from the caller's seeded generator: every arm of a seed sees the same
batches); the inputs are a window's first ``T`` bytes, the targets its last
``T``. Validation is always the same :data:`VALIDATION_WINDOWS` windows
(:meth:`TextCorpus.validation_windows`: non-overlapping windows of the
validation stream chosen once by the fixed seed :data:`VALIDATION_SEED`), so
a validation loss in nats per byte is comparable between arms, seeds and
runs.

Problems (no directory, no text file in it, a file that is not UTF-8 text,
too little text for a split) raise :class:`~kaisa.demo.data.DatasetError`
with a message that says how to install the package.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kaisa.demo.data import DatasetError

__all__ = [
    "DEFAULT_TEXT_DIR",
    "INSTALL_HINT",
    "SKIPPED_SUFFIXES",
    "TEXT_PACKAGE",
    "VALIDATION_PERCENT",
    "VALIDATION_SEED",
    "VALIDATION_WINDOWS",
    "VOCAB_SIZE",
    "TextCorpus",
    "corpus_files",
    "is_validation_record",
    "load_text_corpus",
    "split_records",
]

DEFAULT_TEXT_DIR = "/usr/share/games/fortunes"
"""Where Debian's ``fortunes`` package installs its text files."""

TEXT_PACKAGE = "fortunes"
"""The Debian package of the corpus."""

INSTALL_HINT = (
    f"on Debian, as root: apt-get update && apt-get install -y {TEXT_PACKAGE}; or pass "
    "--text-dir (or set KAISA_TEXT_DIR) to a directory of such files"
)
"""How to get the corpus, appended to every :class:`DatasetError` of this module."""

SKIPPED_SUFFIXES = (".dat", ".u8")
"""File name endings that are not text: ``strfile``'s binary indexes and their links."""

VOCAB_SIZE = 256
"""Byte-level: every byte value is a token."""

VALIDATION_PERCENT = 10
"""Percentage of records (by hash) held out for validation."""

VALIDATION_WINDOWS = 128
"""How many windows the validation loss averages over (fewer if the stream is short)."""

VALIDATION_SEED = 20261125
"""The fixed seed that picks the validation windows, the same for every run."""

#: At most this many bytes of text are read (the package holds about 2.6 MB).
_MAX_BYTES = 1 << 28
_SEPARATOR = "%"


def _error(message: str) -> DatasetError:
    return DatasetError(f"{message} ({INSTALL_HINT})")


def corpus_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The text files of ``directory`` in sorted order: regular files, not hidden, not indexes.

    Subdirectories, hidden files and names ending in :data:`SKIPPED_SUFFIXES`
    are left out; nothing below the directory itself is read.
    """
    d = Path(directory)
    return sorted(
        p
        for p in d.iterdir()
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(SKIPPED_SUFFIXES)
    )


def split_records(text: str) -> list[str]:
    """The records of a fortune file: the text between lines that hold only ``%``.

    A record keeps its lines as they are, without the blank lines around it;
    empty records are dropped. A file without separators is one record.
    """
    records: list[str] = []
    lines: list[str] = []
    for line in [*text.splitlines(), _SEPARATOR]:
        if line.rstrip("\r") == _SEPARATOR:
            record = "\n".join(lines).strip("\n")
            if record.strip():
                records.append(record)
            lines = []
        else:
            lines.append(line.rstrip("\r"))
    return records


def is_validation_record(record: bytes) -> bool:
    """Whether a record (its UTF-8 bytes) is held out: SHA-256 modulo 100 below the percentage.

    A cryptographic hash rather than Python's ``hash()``, which is salted per
    process: the split must be the same on every machine and run.
    """
    digest = hashlib.sha256(record).digest()
    return int.from_bytes(digest[:8], "big") % 100 < VALIDATION_PERCENT


@dataclass(frozen=True)
class TextCorpus:
    """The training and validation byte streams (``uint8``) and what they came from."""

    train: Tensor
    val: Tensor
    directory: str
    files: int
    records: int
    train_records: int
    val_records: int
    fingerprint: str
    """The first 16 hex digits of the SHA-256 of both streams: the same text, the same value."""

    @property
    def vocab_size(self) -> int:
        """The number of token values: :data:`VOCAB_SIZE`."""
        return VOCAB_SIZE

    def steps_per_epoch(self, batch: int, context: int) -> int:
        """Steps of ``batch`` windows of ``context`` bytes in one pass's worth of training bytes."""
        return int(self.train.numel()) // (batch * context)

    def sample_batch(
        self, batch: int, context: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        """``batch`` windows of ``context + 1`` bytes at random offsets: inputs and next bytes.

        Returns ``(x, y)``, both ``(batch, context)`` int64, ``y`` being ``x``
        shifted by one byte. The offsets are drawn from ``generator`` (uniform
        over every position a whole window fits).
        """
        high = int(self.train.numel()) - context
        if high < 1:
            raise ValueError(
                f"the training stream ({self.train.numel()} bytes) is shorter than a window of "
                f"{context + 1} bytes"
            )
        starts = torch.randint(0, high, (batch,), generator=generator)
        windows = self.train[starts[:, None] + torch.arange(context + 1)].long()
        return windows[:, :-1], windows[:, 1:]

    def validation_windows(self, context: int, count: int = VALIDATION_WINDOWS) -> Tensor:
        """The fixed validation windows: ``(min(count, available), context + 1)`` int64.

        The validation stream is cut into non-overlapping windows of
        ``context + 1`` bytes; ``count`` of them are chosen by a generator
        seeded with :data:`VALIDATION_SEED` and kept in stream order. The
        same corpus and ``context`` always give the same windows.
        """
        span = context + 1
        available = int(self.val.numel()) // span
        if available < 1:
            raise ValueError(
                f"the validation stream ({self.val.numel()} bytes) is shorter than a window of "
                f"{span} bytes"
            )
        chosen = torch.randperm(available, generator=torch.Generator().manual_seed(VALIDATION_SEED))
        starts = chosen[: min(count, available)].sort().values * span
        return self.val[starts[:, None] + torch.arange(span)].long()

    def describe(self) -> str:
        """One line: files, records, bytes per stream, where from."""
        return (
            f"{self.files} text files, {self.records} records ({self.val_records} held out): "
            f"{self.train.numel()} training bytes, {self.val.numel()} validation bytes, "
            f"from {self.directory}"
        )


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if b"\x00" in raw:
        raise _error(f"{path}: not a text file (it holds NUL bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _error(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def load_text_corpus(directory: str | os.PathLike[str] = DEFAULT_TEXT_DIR) -> TextCorpus:
    """Read, split and encode the text files of ``directory`` (see the module's docstring).

    Raises :class:`~kaisa.demo.data.DatasetError` when the directory is
    missing, holds no text file, holds a file that is not UTF-8 text, or
    gives an empty training or validation stream.
    """
    d = Path(directory)
    if not d.is_dir():
        raise _error(f"{d}: text corpus directory not found")
    files = corpus_files(d)
    if not files:
        raise _error(
            f"{d}: no text files (files ending in {', '.join(SKIPPED_SUFFIXES)} are skipped)"
        )
    train: list[bytes] = []
    val: list[bytes] = []
    total = 0
    for path in files:
        total += path.stat().st_size
        if total > _MAX_BYTES:
            raise _error(f"{d}: more than {_MAX_BYTES} bytes of text; not a fortune corpus")
        for record in split_records(_read_text(path)):
            data = record.encode("utf-8")
            (val if is_validation_record(data) else train).append(data + b"\n%\n")
    if not train or not val:
        raise _error(
            f"{d}: {len(train) + len(val)} records give an empty "
            f"{'training' if not train else 'validation'} stream"
        )
    train_bytes, val_bytes = b"".join(train), b"".join(val)
    fingerprint = hashlib.sha256(train_bytes + b"\x00" + val_bytes).hexdigest()[:16]
    return TextCorpus(
        train=torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8),
        directory=str(d),
        files=len(files),
        records=len(train) + len(val),
        train_records=len(train),
        val_records=len(val),
        fingerprint=fingerprint,
    )
