"""The suite's data sets by name: Fashion-MNIST for the image workloads, ``fortunes`` for the LM.

A workload names its data set (:attr:`~kaisa.demo.config.Workload.dataset`);
each :class:`~kaisa.demo.config.DemoConfig` carries that name and its
directory. :func:`load_dataset` loads one; :func:`load_suite_data` loads
each (data set, directory) pair a suite needs once, in the order of its
workloads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TypeAlias

from kaisa.demo.config import DemoConfig
from kaisa.demo.data import DEFAULT_DATA_DIR, FashionMNIST, load_fashion_mnist
from kaisa.demo.text import DEFAULT_TEXT_DIR, TextCorpus, load_text_corpus

__all__ = [
    "DATASETS",
    "Dataset",
    "DatasetKey",
    "dataset_hint",
    "dataset_label",
    "default_directory",
    "load_dataset",
    "load_suite_data",
]

Dataset: TypeAlias = FashionMNIST | TextCorpus
"""What a workload trains on."""

DatasetKey: TypeAlias = tuple[str, str]
"""``(data set name, directory)``."""

DATASETS: tuple[str, ...] = ("fashion_mnist", "fortunes")
"""The data sets the suite knows."""

_LABELS = {"fashion_mnist": "Fashion-MNIST", "fortunes": "the fortunes text corpus"}

_HINTS = {
    "fashion_mnist": "Fashion-MNIST IDX .gz files are expected; on Debian: apt-get install "
    "dataset-fashion-mnist, or pass --data-dir",
    # The text loader's messages carry their own hint.
    "fortunes": "",
}


def _check(name: str) -> None:
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; allowed: {', '.join(DATASETS)}")


def dataset_label(name: str) -> str:
    """How tables and messages name the data set."""
    _check(name)
    return _LABELS[name]


def dataset_hint(name: str) -> str:
    """What to do about a :class:`~kaisa.demo.data.DatasetError` of this data set ('' if its
    messages already say)."""
    _check(name)
    return _HINTS[name]


def default_directory(name: str) -> str:
    """The data set's directory when no option names one: its environment variable, else
    the Debian package's."""
    _check(name)
    if name == "fortunes":
        return os.environ.get("KAISA_TEXT_DIR", DEFAULT_TEXT_DIR)
    return os.environ.get("KAISA_DATA_DIR", DEFAULT_DATA_DIR)


def load_dataset(name: str, directory: str) -> Dataset:
    """Load the data set ``name`` from ``directory``; ``DatasetError`` on any problem."""
    _check(name)
    if name == "fortunes":
        return load_text_corpus(directory)
    return load_fashion_mnist(directory)


def load_suite_data(configs: Iterable[DemoConfig]) -> dict[DatasetKey, Dataset]:
    """Every data set ``configs`` need, each (name, directory) loaded once, in their order."""
    out: dict[DatasetKey, Dataset] = {}
    for config in configs:
        key = (config.dataset, config.data_dir)
        if key not in out:
            out[key] = load_dataset(*key)
    return out
