"""Training-framework integrations, one submodule each, imported on demand.

* :mod:`kaisa.integrations.lightning`: :class:`~kaisa.integrations.lightning.KFACCallback`,
  a PyTorch Lightning callback (``pip install 'kaisa[lightning]'``).
* :mod:`kaisa.integrations.accelerate`:
  :func:`~kaisa.integrations.accelerate.prepare_preconditioner`, for Hugging Face
  accelerate loops (``pip install 'kaisa[accelerate]'``).
* :mod:`kaisa.integrations.deepspeed`: gradient access for DeepSpeed engines
  (``pip install 'kaisa[deepspeed]'``).
* :mod:`kaisa.integrations.fsdp`: gradient access for FSDP2 (``fully_shard``)
  gradient shards (torch only).

This package imports no framework: ``import kaisa.integrations`` needs at
most torch, and a submodule whose framework is missing raises an
``ImportError`` naming its extra. See ``docs/lightning-accelerate.md``.
"""
