"""The main job: SGD against SGD + KAISA on Fashion-MNIST, wall-clock time to accuracy.

``kaisa demo`` (``kaisa.demo.cli.main``) trains the same network with both
optimizers over several seeds and reports the median training time to a
target test accuracy, with a table, ``results.json``, a CSV of every
evaluation and a plot. ``--nproc N`` runs the same comparison in N processes
(torchrun, gloo, KAISA distributed).
"""

from kaisa.demo.config import ArmConfig, DemoConfig, KfacConfig
from kaisa.demo.data import DatasetError, FashionMNIST, load_fashion_mnist, read_idx, write_idx

__all__ = [
    "ArmConfig",
    "DatasetError",
    "DemoConfig",
    "FashionMNIST",
    "KfacConfig",
    "load_fashion_mnist",
    "read_idx",
    "write_idx",
]
