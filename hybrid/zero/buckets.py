"""Gradient buckets: each unit's gradients are reduced across the DP group during backward, in one order.

A unit of the layout (``hybrid.plan.layout``) is one bucket. Three modes, one per kind of gradient storage:

* ``all_reduce`` (stage 0): the full flat gradient buffer. At an accumulation boundary each unit is
  all-reduced (averaged) in place.
* ``scatter_full`` (stage 1): the same buffer; each unit is reduce-scattered in place, after which this
  rank's shard of the unit holds the averaged gradient (the rest of the buffer is never read).

  In both, the first backward after the buffer was emptied (``zero_()``, which sets every ``param.grad`` to
  None as torch's ``zero_grad`` does, instead of writing zeros) lets autograd hand over fresh gradients and
  the post-accumulate hook copies each into its view of the buffer; a parameter that got none has its view
  zero-filled at the end of that backward. Later micro-steps of the same step accumulate in place:
  ``param.grad`` are views of the buffer again from the end of each backward. (Accumulating into a zeroed
  buffer read it twice and wrote it twice per step; the copy reads and writes it once.)
* ``scatter_shard`` (stages 2, 3): the post-accumulate hook copies ``param.grad`` into a transient bucket
  buffer (unit length; slots that got no gradient are zeroed at launch) and drops it; the full bucket is
  reduce-scattered in place and this rank's part added into the persistent gradient shard; on CPU reduced
  buckets are kept for the next backward (a ``BufferPool`` of ``KEEP_BUCKET_NUMEL`` elements, in use and
  kept; ``hybrid.plan.layout.kept_bucket_numel`` bounds it). This runs at every micro-step, so only the
  shard (plus buckets in flight and kept) is ever held.

With replicas (``replicas``: ``zero.shard_group`` smaller than the DP group), the reduce-scatter runs inside the
shard group and, at the step's last micro-step, each unit's reduced shard is then all-reduced (averaged) across
the replicas as soon as its reduce-scatter is waited, before ``on_unit_reduced`` hears of it.

When the gradient buffers are in another dtype than the parameters (``zero.reduce_dtype: fp32`` for a bf16
model), autograd cannot accumulate into them: in the first two modes the post-accumulate hook adds each
``param.grad`` into its view of the flat buffer (at every micro-step) and drops it; buckets are in the
buffers' dtype, so the sum over DP is taken in it too.

The mean over DP: where the backend averages inside the collective (NCCL's ``ReduceOp.AVG``) it does;
elsewhere the engine divides the loss by ``loss_divisor`` (the DP size) before backward and the collective
sums, so no pass over the reduced gradients divides them afterwards.

A unit is *complete* once every parameter in it has fired its post-accumulate-grad hook. Units are launched
strictly in ``order`` (the same list on every rank), so the sequence of collectives matches across ranks
even when some parameter gets no gradient on some rank; ``finish()`` (end of backward) launches the rest
(missing gradients are zeros) and waits for everything. With ``overlap`` the collectives stay in flight
while backward continues (for ``scatter_shard`` at most ``max_inflight_numel`` elements of buckets);
without it each one is waited right after it is launched.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Callable, Optional

import torch
from torch.utils.hooks import RemovableHandle

from hybrid.comm.buffer_pool import BufferPool
from hybrid.comm.collectives import Comm
from hybrid.errors import UsageError, first_line
from hybrid.zero.params import SAME_MODULES
from hybrid.plan.layout import KEEP_BUCKET_NUMEL, FlatLayout

MODES = ("all_reduce", "scatter_full", "scatter_shard")


class GradReducer:
    def __init__(self, comm: Comm, layout: FlatLayout, params: list, mode: str, order: list, *,
                 flat_grad: Optional[torch.Tensor] = None, grad_shard: Optional[torch.Tensor] = None,
                 use_reduce_scatter: bool = True, overlap: bool = True, max_inflight_numel: int = 0,
                 on_unit_done: Optional[Callable[[int], None]] = None,
                 on_unit_reduced: Optional[Callable[[int], None]] = None, replicas: Optional[Comm] = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.comm, self.layout, self.params, self.mode, self.order = comm, layout, params, mode, list(order)
        self.flat_grad, self.grad_shard = flat_grad, grad_shard
        self.use_reduce_scatter, self.overlap = use_reduce_scatter, overlap
        self.max_inflight_numel = max_inflight_numel
        self.on_unit_done = on_unit_done
        self.on_unit_reduced = on_unit_reduced  # a unit's reduced gradient is in place (optimizer offload)
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        self._boundary = False        # this backward is the step's last micro-step
        self.rank = comm.rank if layout.n_shards > 1 else 0
        storage = flat_grad if flat_grad is not None else grad_shard
        # Gradients land in another dtype than autograd's: the hook adds them in (stages 0-1).
        self._by_hook = mode != "scatter_shard" and any(p.dtype != storage.dtype for p in params)
        # Where the collective cannot average, the backward pre-divides by the group size (engine.backward).
        self._average_in_collective = True
        self.loss_divisor = 1
        self._empty = True            # the flat buffer holds no gradient since zero_() (stages 0, 1)
        self._handoff = False         # this backward copies fresh gradients into the emptied buffer
        self._written = [False] * len(params)
        self._unit_of = [layout.locate(i) for i in range(len(params))]
        # Per unit, the ranges no parameter occupies (alignment gaps and the tail padding): a kept bucket may
        # come from another unit of the same length whose slots lay there, so they are zeroed at launch.
        self._padding = [u.padding_ranges() for u in layout.units]
        self._buckets: dict = {}      # unit -> bucket buffer not yet launched (scatter_shard)
        self.bucket_pool = BufferPool(KEEP_BUCKET_NUMEL)  # buckets in use and kept for reuse (scatter_shard)
        self._inflight: deque = deque()
        self._active = False
        self._pending = [0] * len(layout.units)
        self._launched = [False] * len(layout.units)
        self._fired = [False] * len(params)
        self.got_grad = [False] * len(params)  # in any micro-step since zero_(): torch's grad is not None
        self._touched = False
        self._next = 0
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]
        self._handles_seen = RemovableHandle.next_id
        for p in params:
            p.grad = None

    # -- views ----------------------------------------------------------------------------------------
    def _unit_range(self, flat: torch.Tensor, u: int) -> torch.Tensor:
        unit = self.layout.units[u]
        return flat[unit.full_offset:unit.full_offset + unit.numel]

    def _grad_view(self, i: int) -> torch.Tensor:
        unit, slot = self._unit_of[i]
        start = unit.full_offset + slot.offset
        return self.flat_grad[start:start + slot.numel].view_as(self.params[i])

    def attach_grads(self) -> None:
        """Point every ``param.grad`` at its view of the flat buffer (again, if the user replaced it); None
        where the hook adds gradients in (another dtype) or while the buffer is empty."""
        if self._by_hook or self._empty:
            for p in self.params:
                p.grad = None
            return
        for i, p in enumerate(self.params):
            view = self._grad_view(i)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def _run_user_hooks_first(self) -> None:
        """The engine's post-accumulate-grad hook takes ``param.grad`` (and sets it to None): it must run after
        every hook the user put on the parameter, also those registered after ``hybrid.initialize``, which
        torch would run after it. Registered again (so last) where it is not the last one. Every hook
        registration anywhere takes the next handle id: while that has not moved, nothing can have changed."""
        if RemovableHandle.next_id == self._handles_seen:
            return
        for i, (p, handle) in enumerate(zip(self.params, self._hook_handles)):
            hooks = getattr(p, "_post_accumulate_grad_hooks", None)
            if hooks and next(reversed(hooks)) != handle.id:
                handle.remove()
                self._hook_handles[i] = p.register_post_accumulate_grad_hook(self._hook(i))
        self._handles_seen = RemovableHandle.next_id

    # -- backward -------------------------------------------------------------------------------------
    def begin(self, reduce: bool) -> None:
        """Start a backward pass; ``reduce`` says whether this micro-step communicates gradients."""
        self._run_user_hooks_first()
        self._boundary = reduce
        self._active = reduce or self.mode == "scatter_shard"
        self._pending = [len(u.slots) for u in self.layout.units]
        self._launched = [False] * len(self.layout.units)
        self._fired = [False] * len(self.params)
        self._touched = False
        self._next = 0
        if self.mode != "scatter_shard":
            self._handoff = self._empty
            self._written = [False] * len(self.params)
            self.attach_grads()
        else:  # gradients only ever live in buckets and the shard
            for p in self.params:
                p.grad = None

    def _hook(self, i: int):
        # A weak reference: the parameter keeps its hooks in C++, where gc cannot see a cycle back to it.
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            reducer = ref()
            if reducer is not None:
                reducer._on_grad(i, param)
        return hook

    @torch.no_grad()
    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        self._touched = True
        self.got_grad[i] = True
        if self._by_hook or self._handoff:
            view = self._grad_view(i)
            if self._handoff and not self._written[i]:
                view.copy_(param.grad)
            else:
                view.add_(param.grad)
            self._written[i] = True
            param.grad = None
        if not self._active:  # a micro-step that only accumulates (stages 0, 1)
            return
        unit, slot = self._unit_of[i]
        if self._launched[unit.index]:
            raise UsageError("a parameter received a second gradient in one backward after its bucket was "
                             "reduced (e.g. reentrant checkpointing around a shared parameter); this is "
                             "not supported")
        first = not self._fired[i]
        self._fired[i] = True
        if self.mode == "scatter_shard":
            bucket = self._buckets.get(unit.index)
            if bucket is None:
                bucket = self._buckets[unit.index] = self._new_bucket(unit.index)
            view = bucket[slot.offset:slot.offset + slot.numel].view_as(param)
            if first:
                view.copy_(param.grad)
            else:
                view.add_(param.grad)
            param.grad = None
        if not first:
            return
        self._pending[unit.index] -= 1
        if self._pending[unit.index] == 0:
            if self.on_unit_done is not None:
                self.on_unit_done(unit.index)
            self._launch_ready()

    def _new_bucket(self, u: int) -> torch.Tensor:
        """A unit-length bucket: a kept one if any, else a new one, uninitialised either way (the pool keys
        buckets by length only, so a kept bucket may have served another unit with other slots): every slot is
        overwritten by its first gradient or zeroed at launch, and the gaps between slots are zeroed at launch,
        so zero-filling a new bucket first was a pass over it for nothing (a 390 MB bucket at 100M)."""
        return self.bucket_pool.take(self.layout.units[u].numel, self.grad_shard.dtype, self.grad_shard.device)

    def _zero_unfired(self, u: int, data: torch.Tensor) -> None:
        """Zero the slots of unit ``u``'s parameters that got no gradient in this backward (a kept bucket
        still holds the last step's sums there)."""
        for slot in self.layout.units[u].slots:
            if not self._fired[slot.param]:
                data[slot.offset:slot.offset + slot.numel].zero_()

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._pending[self.order[self._next]] == 0:
            self._launch(self.order[self._next])
            self._next += 1

    def _launch(self, u: int) -> None:
        self._launched[u] = True
        unit = self.layout.units[u]
        lo, hi = unit.shard_range(self.rank)
        if self.mode == "scatter_shard":
            data = self._buckets.pop(u, None)
            if data is None:
                data = self._new_bucket(u)
            self._zero_unfired(u, data)
            for lo_pad, hi_pad in self._padding[u]:
                data[lo_pad:hi_pad].zero_()
        else:
            data = self._unit_range(self.flat_grad, u)
        average = self._average_in_collective
        if self.mode == "all_reduce" or not self.use_reduce_scatter:
            handle = self.comm.all_reduce(data, average=average, async_op=self.overlap)
        else:
            handle = self.comm.reduce_scatter(data[lo:hi], data, average=average, async_op=self.overlap)
        self._inflight.append((u, handle, data))
        if not self.overlap:
            self._complete_oldest()
        elif self.mode == "scatter_shard":
            while sum(d.numel() for _, _, d in self._inflight) > self.max_inflight_numel and len(self._inflight) > 1:
                self._complete_oldest()

    def _complete_oldest(self) -> None:
        u, handle, data = self._inflight.popleft()
        try:
            handle.wait()
        except RuntimeError as err:  # a collective timeout (gloo); NCCL's watchdog aborts the process instead
            raise RuntimeError(f"ZeRO: the gradient reduction of unit {u} did not complete "
                               f"({first_line(err, limit=200)}): a DP rank died or hung, or the ranks ran "
                               f"different modules; {SAME_MODULES}") from err
        unit = self.layout.units[u]
        lo, hi = unit.shard_range(self.rank)
        shard = data[lo:hi]
        if self.mode == "scatter_shard":
            shard = self.grad_shard[unit.shard_offset:unit.shard_offset + unit.shard_numel]
            shard.add_(data[lo:hi])
            # Kept on CPU only: CUDA's caching allocator already reuses freed blocks without faulting them in.
            self.bucket_pool.give(data, keep=data.device.type == "cpu")
        if self.replicas is not None and self._boundary:
            self.replicas.all_reduce(shard, average=True)
        if self.on_unit_reduced is not None:
            self.on_unit_reduced(u)

    @torch.no_grad()
    def finish(self) -> None:
        """End of backward: launch every unit not yet launched, in order, and wait for all of them."""
        if self._handoff:  # a parameter that got no gradient holds zeros, not the previous step's
            for i, written in enumerate(self._written):
                if not written:
                    self._grad_view(i).zero_()
            self._handoff = self._empty = False
        if self._active:
            for u in range(len(self._pending)):
                if self._pending[u] > 0:
                    self._pending[u] = 0
                    if self.on_unit_done is not None:
                        self.on_unit_done(u)
            self._launch_ready()
        while self._inflight:
            self._complete_oldest()
        self._buckets.clear()
        reduced, self._active = self._active, False
        if self.mode == "scatter_full" and reduced:
            # Only this rank's shard of the flat buffer is reduced: the rest still holds its local sums, which
            # a user's clip_grad_norm_ would read as gradients. None, as at stages 2-3.
            for p in self.params:
                p.grad = None
        elif self.mode != "scatter_shard":
            self.attach_grads()

    def started(self) -> bool:
        """Whether any gradient of the current backward has reached the engine (accumulated or handed over)."""
        return self._touched

    # -- bookkeeping ----------------------------------------------------------------------------------
    def transient_tensors(self) -> list:
        """Bucket buffers alive right now (between begin() and finish())."""
        return list(self._buckets.values()) + [d for _, _, d in self._inflight if self.mode == "scatter_shard"]

    def kept_tensors(self) -> list:
        """Reduced buckets kept for reuse by the next backward (scatter_shard)."""
        return self.bucket_pool.kept()

    def zero_(self) -> None:
        """Forget the gradients: the shard is zeroed (stages 2, 3); the flat buffer is marked empty and the
        next backward overwrites it (stages 0, 1)."""
        self.got_grad = [False] * len(self.params)
        if self.mode == "scatter_shard":
            self.grad_shard.zero_()
            return
        self._empty = True
        self.attach_grads()

    def fill_if_empty(self) -> None:
        """Make an emptied flat buffer read as zeros (an optimizer step with no backward since zero_())."""
        if self.mode != "scatter_shard" and self._empty:
            self.flat_grad.zero_()
            self._empty = False
            self.attach_grads()
