"""Pipeline parallelism (``torch.distributed.pipelining``): its shape-inference pass.

A pipeline stage needs no gradient access of its own: each stage is a plain
module (or a DDP/FSDP2 one), preconditioned over its data-parallel group
(``process_group=``), with ``accumulation_steps`` micro-batches per step. What
the pipeline adds is one pass kaisa must not count: ``PipelineStage`` (built
without static ``input_args``/``output_args``) runs the stage module once on
placeholder tensors to learn its shapes, with autograd on, and on the last
stage a backward pass through them. :func:`inferring_pipeline_shapes` tells
such a forward call from a micro-batch's.

``torch.distributed.pipelining`` is never imported here: a model can be a
pipeline stage only when it is already imported.
"""

from __future__ import annotations

import sys

#: Functions of ``torch.distributed.pipelining`` that run the stage module on
#: placeholder tensors to learn its shapes (the first step of a schedule).
SHAPE_INFERENCE = frozenset({"_forward_metadata_inference", "_shape_inference"})

#: How many frames above its caller :func:`inferring_pipeline_shapes` looks.
_MAX_DEPTH = 64


def inferring_pipeline_shapes() -> bool:
    """Whether the forward call being run comes from a pipeline stage's shape inference.

    Looks up the stack from the function that calls this one (a forward hook
    of the model) for one of :data:`SHAPE_INFERENCE` defined in
    ``torch.distributed.pipelining``.
    """
    if "torch.distributed.pipelining" not in sys.modules:
        return False
    frame = sys._getframe(1)  # the caller's frame: this function's own is never a match
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name in SHAPE_INFERENCE and "pipelining" in code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
