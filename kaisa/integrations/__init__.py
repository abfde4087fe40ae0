"""Training-framework integrations (wrappers), one submodule each, imported on demand.

* :mod:`kaisa.integrations.lightning`: :class:`~kaisa.integrations.lightning.KFACCallback`,
  a PyTorch Lightning callback (``pip install 'kaisa[lightning]'``).
* :mod:`kaisa.integrations.transformers`:
  :class:`~kaisa.integrations.transformers.KFACCallback`, a HuggingFace ``Trainer``
  callback (``pip install 'kaisa[transformers]'``).
* :mod:`kaisa.integrations.accelerate`:
  :func:`~kaisa.integrations.accelerate.prepare_preconditioner`, for Hugging Face
  accelerate loops (``pip install 'kaisa[accelerate]'``).

These wrap the front door (:class:`~kaisa.KFACPreconditioner`) for a training
framework. The engines of parallelism the front door itself chooses from the
model (DDP, DeepSpeed, FSDP2, pipeline stages) live in :mod:`kaisa.engines`.

This package imports no framework: ``import kaisa.integrations`` needs at
most torch, and a submodule whose framework is missing raises an
``ImportError`` naming its extra. See ``docs/lightning-accelerate.md``.
"""
