"""The main job: a time-to-accuracy benchmark suite of optimizers with and without KAISA.

``kaisa demo`` (``kaisa.demo.cli.main``) trains each workload of
:data:`~kaisa.demo.config.WORKLOADS` (a network from :mod:`kaisa.models` with a
target test accuracy and an epoch budget) on Fashion-MNIST with each optimizer
arm (SGD, AdamW, Muon + AdamW, SOAP, and SGD or AdamW behind the K-FAC
preconditioner with the library's defaults) over several seeds, and reports
the median training time to the target per (workload, arm): per workload a
table, ``results.json``, a CSV of every evaluation and a plot, then a summary
over workloads. ``--nproc N`` runs the same suite in N processes (torchrun,
gloo, DDP, KAISA distributed).
"""

from kaisa.demo.config import (
    ARM_NAMES,
    WORKLOADS,
    ArmConfig,
    DemoConfig,
    KfacConfig,
    SuiteConfig,
    Workload,
)
from kaisa.demo.data import DatasetError, FashionMNIST, load_fashion_mnist, read_idx, write_idx

__all__ = [
    "ARM_NAMES",
    "WORKLOADS",
    "ArmConfig",
    "DatasetError",
    "DemoConfig",
    "FashionMNIST",
    "KfacConfig",
    "SuiteConfig",
    "Workload",
    "load_fashion_mnist",
    "read_idx",
    "write_idx",
]
