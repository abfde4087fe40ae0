"""The main job: a time-to-target benchmark suite of optimizers with and without KAISA.

``kaisa demo`` (``kaisa.demo.cli.main``) trains each workload of
:data:`~kaisa.demo.config.WORKLOADS` (a network from :mod:`kaisa.models` with
its data, a metric, a target and a budget: image classifiers on Fashion-MNIST
to a test accuracy, a byte-level GPT on the ``fortunes`` text corpus down to a
validation loss, :mod:`kaisa.demo.text`) with each optimizer arm (SGD, AdamW,
Muon + AdamW, SOAP, and SGD or AdamW behind the K-FAC preconditioner with the
library's defaults) over several seeds, and reports the median training time
to the target per (workload, arm): per workload a table, ``results.json``, a
CSV of every evaluation and a plot, then a summary over workloads.
``--nproc N`` runs the same suite in N processes (torchrun, gloo, DDP, KAISA
distributed).
"""

from kaisa.demo.config import (
    ARM_NAMES,
    METRICS,
    WORKLOADS,
    ArmConfig,
    DemoConfig,
    KfacConfig,
    Metric,
    SuiteConfig,
    Workload,
)
from kaisa.demo.data import DatasetError, FashionMNIST, load_fashion_mnist, read_idx, write_idx
from kaisa.demo.text import TextCorpus, load_text_corpus

__all__ = [
    "ARM_NAMES",
    "METRICS",
    "WORKLOADS",
    "ArmConfig",
    "DatasetError",
    "DemoConfig",
    "FashionMNIST",
    "KfacConfig",
    "Metric",
    "SuiteConfig",
    "TextCorpus",
    "Workload",
    "load_fashion_mnist",
    "load_text_corpus",
    "read_idx",
    "write_idx",
]
