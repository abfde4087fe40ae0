"""Traffic of one KAISA plan: bucketed factor all-reduce and the two broadcasts.

The communicator owns the process groups (created once, at construction, by
every rank in the same order, as ``torch.distributed.new_group`` requires):
one of all ranks for the factor all-reduce, one per gradient-worker column
with more than one member and one per receiver row with more than one member.
With one rank, or without an initialised process group, every operation is
local and sends nothing.

All collectives are launched asynchronously and waited for in a fixed order,
so every rank issues the same calls on each group in the same order. The
factor all-reduce is launched from backward hooks, at moments that depend on
what each rank's backward pass does, so it has a group of its own (its calls
cannot interleave differently with DDP's or the user's on the default group)
and its buckets are launched strictly in bucket order (a layer one rank did
not capture holds back the later buckets there until ``reduced_factors``).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kaisa.curvature.costs import Capture, SideSpec
from kaisa.distributed.agreement import check_agreement, seconds_from_env
from kaisa.distributed.cost import bucket_layers
from kaisa.distributed.plan import WorkPlan
from kaisa.telemetry import Telemetry

Work = dist.Work

#: One piece of a layer's factor payload: the side (``'a'`` or ``'g'``) and what
#: was captured for it (``'gram'``: the ``n × n`` row products; ``'moments'``:
#: the ``(2, n)`` sums of the rows and of their squares).
PayloadKey = tuple[str, Capture]
#: A layer's payload: per key, the sum over this rank's rows and the row count.
Payload = dict[PayloadKey, tuple[torch.Tensor, float]]


def payload_layout(
    keys: Mapping[str, Sequence[PayloadKey]], plan: WorkPlan
) -> dict[str, tuple[tuple[PayloadKey, int], ...]]:
    """Each layer's payload pieces ``((side, capture), n)``: what it captures, with its sides.

    ``keys``: per layer of the plan, the pieces it captures, in a fixed order
    (the same on every rank); the sides come from the plan.
    """
    return {
        la.name: tuple((key, la.a_size if key[0] == "a" else la.g_size) for key in keys[la.name])
        for la in plan.layers
    }


def plan_layout(plan: WorkPlan) -> dict[str, tuple[tuple[PayloadKey, int], ...]]:
    """The payload of each layer held as the plan records: one piece per side."""
    return payload_layout(
        {
            la.name: (
                ("a", SideSpec.parse(la.a_spec).capture),
                ("g", SideSpec.parse(la.g_spec).capture),
            )
            for la in plan.layers
        },
        plan,
    )


def data_parallel_group(group: object) -> dist.ProcessGroup | None:
    """``group`` checked as the data-parallel group to plan over (``None``: the whole world).

    Refused: something that is not a process group, a group this process is
    not a member of (``new_group`` gives non-members a sentinel), or a group
    without an initialised ``torch.distributed``.
    """
    if group is None:
        return None
    outside = ValueError(
        "kaisa: process_group does not contain this process: build each "
        "preconditioner on the members of its data-parallel group"
    )
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise outside
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup (e.g. from "
            f"dist.new_group) or None for the whole world; got {type(group).__name__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "kaisa: process_group was given but torch.distributed is not initialised"
        )
    if group is dist.GroupMember.WORLD:
        return None
    if dist.get_rank(group) < 0:
        raise outside
    return group


def default_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (the default process group when ``None``).

    ``(0, 1)`` without an initialised process group; ``group`` as
    :func:`data_parallel_group` returns it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


_TRIU_CACHE: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _triu(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (n, str(device))
    if key not in _TRIU_CACHE:
        rows, cols = torch.triu_indices(n, n, device=device)
        _TRIU_CACHE[key] = (rows, cols)
    return _TRIU_CACHE[key]


def pack_symmetric(matrix: torch.Tensor) -> torch.Tensor:
    """The upper triangle (diagonal included) of a symmetric matrix, row by row."""
    rows, cols = _triu(matrix.shape[0], matrix.device)
    return matrix[rows, cols]


def unpack_symmetric(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_symmetric`: the full symmetric ``n × n`` matrix."""
    rows, cols = _triu(n, packed.device)
    out = packed.new_zeros(n, n)
    out[rows, cols] = packed
    out[cols, rows] = packed
    return out


def packed_numel(n: int, symmetric: bool) -> int:
    return n * (n + 1) // 2 if symmetric else n * n


def payload_numel(capture: Capture, n: int, symmetric: bool) -> int:
    """Elements one payload piece sends (triangles only for a symmetric gram)."""
    return 2 * n if capture == "moments" else packed_numel(n, symmetric)


#: The environment variable holding the timeout of kaisa's collectives, in seconds.
TIMEOUT_ENV = "KAISA_COLLECTIVE_TIMEOUT_S"
#: The timeout when :data:`TIMEOUT_ENV` is not set: NCCL's own default, 10 minutes.
DEFAULT_TIMEOUT_S = 600.0


class CollectiveTimeoutError(RuntimeError):
    """A collective of ``step()`` timed out: a peer has not reached ``step()``.

    After it the job should end: the backend has given up on the peer.
    """


def collective_timeout() -> float:
    """The timeout of kaisa's collectives from :data:`TIMEOUT_ENV` (default 600 s)."""
    return seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


@dataclass
class _Bucket:
    names: tuple[str, ...]
    ready: dict[str, Payload] = field(default_factory=dict)
    work: Work | None = None
    buffer: torch.Tensor | None = None


class Communicator:
    """Collectives for one :class:`~kaisa.distributed.plan.WorkPlan` on one rank.

    Args:
        plan: the work plan (shared by all ranks).
        rank: this process's rank in ``group`` (the plan's ranks are group ranks).
        telemetry: where traffic is counted.
        bucket_cap_mb: upper bound on one factor all-reduce bucket (MiB of
            float32 payload); layers are bucketed in reverse registration order,
            the order in which their backward hooks usually finish.
        symmetry_aware: send only upper triangles of the factors.
        device, dtype: where and in which dtype the factors live (for the zeros
            sent for a layer this rank did not capture).
        group: the data-parallel process group the plan spans (``None``: the
            default group, the whole world). kaisa's own groups are made of
            its members; with a group, only its members take part in making
            them (``use_local_synchronization``), so each pipeline stage or
            model-parallel shard can build its own preconditioner.
    """

    def __init__(
        self,
        plan: WorkPlan,
        rank: int,
        telemetry: Telemetry,
        *,
        bucket_cap_mb: float = 25.0,
        symmetry_aware: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        layout: Mapping[str, Sequence[tuple[PayloadKey, int]]] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.group = group
        self.world_size = plan.world_size
        self.telemetry = telemetry
        self.symmetry_aware = symmetry_aware
        self.device = device if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.allreduce_group: dist.ProcessGroup | None = None
        self.column_groups: dict[int, dist.ProcessGroup | None] = {}
        self.row_groups: dict[int, dist.ProcessGroup | None] = {}
        self.global_ranks = list(range(self.world_size))
        if self.world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("a work plan for several ranks needs torch.distributed")
            self._make_groups()
        self._bucket_cap_mb = bucket_cap_mb
        self.set_layout(layout if layout is not None else plan_layout(plan), plan)

    def set_layout(
        self, layout: Mapping[str, Sequence[tuple[PayloadKey, int]]], plan: WorkPlan | None = None
    ) -> None:
        """What each layer sends in the factor all-reduce (and, optionally, a new plan).

        ``layout`` maps every layer of the plan to its payload pieces
        ``((side, capture), n)``, in a fixed order. Called between steps (no
        bucket in flight), with the same arguments on every rank; the process
        groups do not change, so a new plan must keep the world size and the
        number of gradient workers.
        """
        if plan is not None:
            if (plan.world_size, plan.grad_workers) != (
                self.plan.world_size,
                self.plan.grad_workers,
            ):
                raise ValueError("a new plan must keep the world size and gradient workers")
            self.plan = plan
        if any(b.ready or b.work is not None for b in getattr(self, "_buckets", [])):
            raise RuntimeError("kaisa: the factor layout changed while factors were in flight")
        names = [la.name for la in self.plan.layers]
        if sorted(layout) != sorted(names):
            raise ValueError("the factor layout must name every layer of the plan")
        self._layout = {name: tuple(layout[name]) for name in names}
        self._buckets = self._make_buckets(self._bucket_cap_mb)
        self._bucket_of = {name: b for b in self._buckets for name in b.names}

    def regroup(
        self, plan: WorkPlan, layout: Mapping[str, Sequence[tuple[PayloadKey, int]]]
    ) -> None:
        """Adopt a plan with another number of gradient workers (a restored choice).

        Collective: every rank of the group must call it, with the same
        ``plan``, between steps. The ranks first compare the new number of
        gradient workers (:func:`~kaisa.distributed.agreement.check_agreement`:
        ranks that differ, or one that does not come, raise
        :class:`~kaisa.distributed.agreement.RankDisagreementError`), then make
        the new column and row groups.
        """
        if plan.world_size != self.world_size:
            raise ValueError("a new plan must keep the world size")
        if any(b.ready or b.work is not None for b in self._buckets):
            raise RuntimeError("kaisa: the plan changed while factors were in flight")
        if self.distributed:
            check_agreement({"restored grad_workers": plan.grad_workers}, self.group)
            self.plan = plan
            self.column_groups, self.row_groups = {}, {}
            self._make_groups()
        self.plan = plan
        self.set_layout(layout, plan)

    # -- groups ----------------------------------------------------------------
    def _make_groups(self) -> None:
        plan = self.plan
        m, cols, n = plan.grad_workers, plan.num_columns, plan.world_size
        self.timeout_s = collective_timeout()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        outer = self.group
        if outer is not None and dist.get_world_size(outer) != n:
            raise ValueError(
                f"kaisa: the plan spans {n} ranks, process_group has {dist.get_world_size(outer)}"
            )
        #: Global rank of each plan rank (collectives name sources by global rank).
        self.global_ranks = [
            r if outer is None else dist.get_global_rank(outer, r) for r in range(n)
        ]

        def new_group(ranks: Sequence[int]) -> dist.ProcessGroup:
            members = [self.global_ranks[r] for r in ranks]
            # With the whole world every process creates every group, in the
            # same order; with a data-parallel group only its members do
            # (other groups, e.g. another pipeline stage's, are made elsewhere).
            made: dist.ProcessGroup = dist.new_group(
                members, timeout=timeout, use_local_synchronization=outer is not None
            )
            return made

        # kaisa's own groups (the whole plan included) carry kaisa's timeout,
        # so that a peer that never reaches step() is an error after minutes,
        # not the default group's 30 (gloo).
        self.allreduce_group = new_group(range(n))
        for c in range(cols):
            ranks = plan.column_ranks(c)
            if m == n:
                self.column_groups[c] = self.allreduce_group
            elif m > 1 and (outer is None or self.rank in ranks):
                group = new_group(ranks)
                if self.rank in ranks:
                    self.column_groups[c] = group
        for r in range(m):
            ranks = plan.row_ranks(r)
            if cols == n:
                self.row_groups[r] = self.allreduce_group
            elif cols > 1 and (outer is None or self.rank in ranks):
                group = new_group(ranks)
                if self.rank in ranks:
                    self.row_groups[r] = group

    def _wait(self, work: Work, what: str) -> None:
        """``work.wait()``, a timeout turned into :class:`CollectiveTimeoutError`."""
        try:
            work.wait()
        except RuntimeError as error:
            if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
                raise
            raise CollectiveTimeoutError(
                f"kaisa: rank {self.rank}: the {what} of preconditioner.step() did not "
                f"complete within {self.timeout_s:g} s ({TIMEOUT_ENV}): a peer has not "
                "reached step() — every rank must call it at every step, with the same "
                "registered layers"
            ) from error

    # -- factor all-reduce -------------------------------------------------------
    def _make_buckets(self, cap_mb: float) -> list[_Bucket]:
        sizes = [
            (
                la.name,
                sum(
                    payload_numel(capture, n, self.symmetry_aware)
                    for (_, capture), n in self._layout[la.name]
                ),
            )
            for la in self.plan.layers
        ]
        return [_Bucket(names) for names in bucket_layers(sizes, cap_mb)]

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def submit_factors(self, name: str, payload: Payload) -> None:
        """Hand over one layer's factor sums for this step and the rows they sum over.

        ``payload`` holds, for every piece of the layer's layout, the sum over
        this rank's rows (``n × n`` products or ``(2, n)`` moments) and the row
        count. :meth:`reduced_factors` divides the sums over all ranks by the
        rows over all ranks, so the batch factors are the mean over every row
        that went through the layer on any rank (a rank whose forward pass
        skipped the layer adds nothing). The sums are divided in place. The
        layer's bucket is all-reduced (asynchronously) as soon as all of its
        layers and all earlier buckets are in; :meth:`reduced_factors` sends
        whatever is left.
        """
        bucket = self._bucket_of[name]
        if bucket.work is not None or name in bucket.ready:
            raise RuntimeError(
                f"kaisa: factors of layer {name!r} were captured after they were sent this "
                "step; the number of forward/backward passes per step must equal "
                "accumulation_steps"
            )
        expected = [key for key, _ in self._layout[name]]
        if sorted(payload) != sorted(expected):
            raise ValueError(
                f"kaisa: layer {name!r} submitted {sorted(payload)}, its layout is {expected}"
            )
        bucket.ready[name] = payload
        if self.distributed:
            for queued in self._buckets:  # in bucket order, up to the first incomplete one
                if queued.work is None:
                    if len(queued.ready) < len(queued.names):
                        break
                    self._launch(queued)

    def _pack(self, capture: Capture, tensor: torch.Tensor) -> torch.Tensor:
        if capture == "gram" and self.symmetry_aware:
            return pack_symmetric(tensor)
        return tensor.reshape(-1)

    def _launch(self, bucket: _Bucket) -> None:
        # The factor sums, then their row counts at the end of the buffer: the
        # sums over ranks divide into the mean over all rows (see _unpack).
        pieces: list[torch.Tensor] = []
        rows: list[float] = []
        for name in bucket.names:
            payload = bucket.ready.get(name)
            for key, n in self._layout[name]:
                if payload is not None:
                    tensor, count = payload[key]
                else:  # not captured on this rank this step: contributes nothing
                    shape = (n, n) if key[1] == "gram" else (2, n)
                    tensor = torch.zeros(shape, device=self.device, dtype=self.dtype)
                    count = 0.0
                pieces.append(self._pack(key[1], tensor))
                rows.append(float(count))
        pieces.append(torch.tensor(rows, device=self.device, dtype=pieces[0].dtype))
        buffer = torch.cat(pieces)
        with self.telemetry.timer("factor_allreduce"):
            bucket.work = dist.all_reduce(buffer, group=self.allreduce_group, async_op=True)
        bucket.buffer = buffer
        self.telemetry.count("factor_allreduce", buffer[: -len(rows)])
        self.telemetry.count("factor_rows", buffer[-len(rows) :])

    def reduced_factors(self) -> dict[str, dict[PayloadKey, tuple[torch.Tensor, float]]]:
        """Batch factors: the submitted sums divided by their rows, over all ranks.

        For every layer, each payload piece's mean over the rows and those rows
        per rank (the rows over all ranks divided by the world size; equal on
        every rank). With one rank: the layers captured this step. With several:
        waits for the launched buckets and launches the rest, in the same order
        on every rank, so that every bucket is reduced on every factor-update
        step. As sums and rows add up over ranks, a layer that some ranks did
        not call (a data-dependent branch) is averaged over the rows of the
        ranks that did, as one process would; one captured on no rank comes
        back as zeros with 0 rows (the caller skips it). With equal row counts
        on every rank this is spec §5's plain average of the ranks' batch
        factors. Clears the buckets.
        """
        result: dict[str, dict[PayloadKey, tuple[torch.Tensor, float]]] = {}
        if not self.distributed:
            for bucket in self._buckets:
                for name, payload in bucket.ready.items():
                    result[name] = {
                        key: (tensor.div_(count), count) for key, (tensor, count) in payload.items()
                    }
                bucket.ready = {}
            return result
        for bucket in self._buckets:
            if bucket.work is None:
                self._launch(bucket)
        with self.telemetry.timer("factor_allreduce"):
            for bucket in self._buckets:
                assert bucket.work is not None
                self._wait(bucket.work, "factor all-reduce")
        for bucket in self._buckets:
            result.update(self._unpack(bucket))
            bucket.ready, bucket.work, bucket.buffer = {}, None, None
        return result

    def _unpack(self, bucket: _Bucket) -> dict[str, dict[PayloadKey, tuple[torch.Tensor, float]]]:
        assert bucket.buffer is not None
        buffer = bucket.buffer
        pieces = sum(len(self._layout[name]) for name in bucket.names)
        # Rows per piece summed over the ranks; 0 (captured nowhere) leaves zeros.
        totals = iter(buffer[-pieces:].tolist())
        out: dict[str, dict[PayloadKey, tuple[torch.Tensor, float]]] = {}
        offset = 0
        for name in bucket.names:
            layer: dict[PayloadKey, tuple[torch.Tensor, float]] = {}
            for key, n in self._layout[name]:
                total = float(next(totals))
                numel = payload_numel(key[1], n, self.symmetry_aware)
                flat = buffer[offset : offset + numel].div_(max(total, 1.0))
                offset += numel
                if key[1] == "moments":
                    tensor = flat.view(2, n)
                elif self.symmetry_aware:
                    tensor = unpack_symmetric(flat, n)
                else:
                    tensor = flat.view(n, n)
                layer[key] = (tensor, total / self.world_size)
            out[name] = layer
        return out

    # -- agreement ----------------------------------------------------------------
    def any_rank(self, flags: Sequence[bool]) -> list[bool]:
        """For each flag, whether it is set on any rank (a tiny all-reduce).

        Used to agree on which layers took part in a step, so that a layer a
        data-dependent branch skipped on some ranks is treated alike everywhere.
        Counted in telemetry as 'layer_flags', outside spec §5's cost model.
        """
        if not self.distributed or not flags:
            return list(flags)
        tensor = torch.tensor([1.0 if f else 0.0 for f in flags], device=self.device)
        work = dist.all_reduce(tensor, group=self.allreduce_group, async_op=True)
        assert work is not None
        self._wait(work, "layer agreement")
        self.telemetry.count("layer_flags", tensor)
        return [value > 0 for value in tensor.tolist()]

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Each value's maximum over the ranks (a tiny all-reduce, float64).

        Used once per run, to make the budget's clock calibration equal on every
        rank. Counted in telemetry as 'layer_flags', outside spec §5's cost model.
        """
        if not self.distributed or not values:
            return [float(v) for v in values]
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        work = dist.all_reduce(
            tensor, op=dist.ReduceOp.MAX, group=self.allreduce_group, async_op=True
        )
        assert work is not None
        self._wait(work, "budget calibration")
        self.telemetry.count("layer_flags", tensor)
        return [float(v) for v in tensor.tolist()]

    def gather_values(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same count on each), in rank order (float64).

        A tiny all-gather: the schedules' check (:class:`~kaisa.distributed.
        agreement.ScheduleCheck`). Counted in telemetry as 'layer_flags',
        outside spec §5's cost model.
        """
        mine = [float(v) for v in values]
        if not self.distributed or not mine:
            return [mine]
        tensor = torch.tensor(mine, dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, tensor, group=self.allreduce_group, async_op=True)
        assert work is not None
        self._wait(work, "schedule agreement")
        self.telemetry.count("layer_flags", tensor)
        return [row.tolist() for row in gathered]

    # -- broadcasts ---------------------------------------------------------------
    def broadcast_decompositions(
        self,
        states: Mapping[str, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
    ) -> None:
        """Broadcast each layer's second-order state inside its gradient-worker column.

        ``states`` maps each layer whose column holds this rank (those this
        rank preconditions, :meth:`WorkPlan.is_grad_worker`) to the state
        tensors of its ``A`` and of its ``G``, in the same layer order on every
        rank of the column. The plan names each side's owner (its
        ``a_rank`` / ``g_rank``), which sends; the rest of the column
        receives in place. A no-op when columns have one member.
        """
        if self.plan.grad_workers == 1:
            return
        works: list[Work] = []
        with self.telemetry.timer("inverse_broadcast"):
            for name, sides in states.items():
                assignment = self.plan.layer(name)
                group = self.column_groups[assignment.column]
                owners = (assignment.a_rank, assignment.g_rank)
                for owner, tensors in zip(owners, sides, strict=True):
                    for tensor in tensors:
                        works.append(_broadcast(tensor, self.global_ranks[owner], group))
                        self.telemetry.count("inverse_broadcast", tensor)
            for work in works:
                self._wait(work, "decomposition broadcast")

    def broadcast_gradients(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Broadcast preconditioned gradients inside this rank's row.

        ``items`` holds ``(layer name, tensor)`` in the same layer order on every
        rank; the plan names the source (the row's rank in the layer's
        column, :meth:`WorkPlan.gradient_source`), which sends its
        preconditioned gradient; the others receive into theirs. A no-op when
        rows have one member (COMM-OPT).
        """
        if self.plan.num_columns == 1:
            return
        group = self.row_groups[self.plan.row_of(self.rank)]
        works: list[Work] = []
        with self.telemetry.timer("grad_broadcast"):
            for name, tensor in items:
                if not tensor.is_contiguous():  # a collective sends memory order, not shape
                    raise RuntimeError("kaisa: a gradient to broadcast must be contiguous")
                src = self.plan.gradient_source(name, self.rank)
                works.append(_broadcast(tensor, self.global_ranks[src], group))
                self.telemetry.count("grad_broadcast", tensor)
            for work in works:
                self._wait(work, "gradient broadcast")


def _broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> Work:
    work: Work | None = dist.broadcast(tensor, src=src, group=group, async_op=True)
    assert work is not None
    return work
