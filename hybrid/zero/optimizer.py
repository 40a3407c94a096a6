"""Any elementwise ``torch.optim`` optimizer stepped over this rank's flat fp32 shard, in ``sub_group_size`` batches.

The shard is a list of ``Piece``s: the part of one parameter this rank owns (``hybrid.plan.layout``'s ``owned_pieces``),
as a view of the fp32 master, of the reduced gradient and, when the master is a separate copy (bf16, or
offloaded), of the model-dtype parameter shard that receives the updated values. Pieces are packed in
shard order into batches of at most ``sub_group_size`` elements (a larger piece is cut); each batch is one
``torch.optim`` instance whose parameter groups are the batch's pieces by ``param_groups.Group``, so one
fused (or foreach) kernel call per group steps a whole batch -- with the default sub-group size and fp32
gradients, all of a rank's pieces at once. Non-fp32 (bf16) gradients are converted into one fp32 scratch
buffer of one batch, by one rule of the device the kernels run on (``hybrid.plan.layout.step_rule``; the
memory model sizes the scratch by its ``batch_numel``): on CPU at most ``CONVERT_NUMEL`` elements, a small
reused scratch, each piece converted and scaled in turn while it is in cache; on a GPU the whole sub-group,
bounded by the free memory the engine lets it use (``scratch_bytes``), released after each step, and every
batch costs the same few calls whatever its size: one ``torch._foreach_copy_`` converting its gradients, one
``_foreach_mul_`` clipping them (in place: the reduced gradient is zeroed after the step anyway), the
optimizer's own, and one ``_foreach_copy_`` writing the updated values back -- so a step's calls grow with
the number of batches and parameter groups, not with the element count.

The optimizer's per-element state (``exp_avg`` and ``exp_avg_sq`` for Adam(W), ``momentum_buffer`` for SGD,
whatever an elementwise class keeps: found by stepping it once on a 2-element probe) lives in one flat
fp32 buffer per key in shard space (``buffers``), so a checkpoint writes it per parameter like the master.
Where the class steps from zeroed state exactly as from the state it would make itself
(``zero_state_is_initial``: Adam(W), SGD without dampening, ...) every piece's state points at the buffers
from the start; otherwise torch creates a piece's state on its first step, it is copied into the flat
buffer and the piece's state points there (every later step updates it in place). A scalar ``step`` entry is this optimizer's
``step_count``; any other scalar state makes the class not elementwise (refused in one sentence).
``restore(step_count)`` re-creates the state entries over the (just loaded) buffers, so a resumed run takes
exactly the steps an uninterrupted one would.

With ``state_device`` the CPU while the model is on another device (optimizer offload), the masters and
buffers live in host memory and each piece's gradient is its view of the host copy of the gradient shard
(``state.FlatState.copy_grads_to_host`` fills it); the kernels run on the host, and the updated values
are copied back to the device parameter views (``Piece.out``) in the model dtype -- non-blocking from pinned
memory (``non_blocking``), the next write to the master waiting for them (``wait_writeback``). Given the
rank's host ``arena`` (``host_arena.HostArena``), the state buffers are views of it.

With ``swap_path`` (optimizer offload to NVMe) there are no masters or buffers in memory: each batch is one
record of a ``hybrid.zero.nvme.SwapStore`` at that path (fields ``master`` and the state keys), and every
pass over the batches (``_placed``: the step, ``copy_master_to_params``) sweeps the file -- a batch's views
and their torch state are bound to its record's host buffer (``_bind``), the same step runs, and the record
is written back while the next is read. The records are the batches of the host's step rule, so a step is
bit for bit the one of host memory (same batches, same kernels). The pieces' ``master`` are then placeholders
of the right length; ``read_shard`` / ``write_shard`` read and store element ranges in shard space (the
first values, checkpoints: ``SwappedRange``). The write-back to the device is blocking there: a record's
buffer is read into again two records later.
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from hybrid.config.training import OptimizerConfig
from hybrid.errors import ConfigError
from hybrid.plan.layout import bucket_groups, step_rule

MASTER = "master"  # the swap records' field of the fp32 master (beside the state keys)


class Fp32Scratch:
    """One reused fp32 buffer per device into which non-fp32 gradients are converted a bounded chunk at a
    time -- by the optimizer's batches and by the gradient norm (``clip``), which run one after the other, so
    the engine gives both the same instance. Allocated on first use, regrown only when a longer view is asked."""

    def __init__(self):
        self._buffers: dict = {}

    def release(self, device) -> None:
        """Drop the buffer held on ``device`` (the next ``view`` allocates again)."""
        self._buffers.pop(torch.device(device), None)

    def view(self, n: int, device) -> torch.Tensor:
        device = torch.device(device)
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < n:
            buf = self._buffers[device] = torch.empty(n, dtype=torch.float32, device=device)
        return buf[:n]

    def tensors(self, device) -> list:
        """The buffer held on ``device`` (empty until first use)."""
        buf = self._buffers.get(torch.device(device))
        return [] if buf is None else [buf]


@dataclass
class Piece:
    master: torch.Tensor           # fp32, updated in place
    grad: torch.Tensor             # the gradient the optimizer reads (the host copy when offloaded)
    pos: int                       # where the piece starts in shard space (state buffers)
    out: Optional[torch.Tensor]    # model-dtype parameter view receiving the update, or None (master is it)
    group: int = 0                 # index into the parameter groups
    param: int = -1                # the parameter's index in the layout (which ones got no gradient: step)


def probe_state(cls, kwargs: dict) -> tuple:
    """``(per-element state keys, step dtype or None)`` of ``cls``, from one step on a 2-element probe."""
    p = torch.zeros(2)
    p.grad = torch.ones(2)
    opt = cls([p], **kwargs, foreach=False)
    opt.step()
    keys, step_dtype = [], None
    for key, value in opt.state[p].items():
        if torch.is_tensor(value) and value.shape == p.shape:
            keys.append(key)
        elif key == "step" and (torch.is_tensor(value) and value.dim() == 0 or isinstance(value, (int, float))):
            step_dtype = value.dtype if torch.is_tensor(value) else torch.float32
        else:
            raise ConfigError(f"optimizer.type {cls.__name__} keeps state {key!r} that is not one value per parameter "
                              f"element, so it cannot be stepped on ZeRO's flat shards; use an elementwise "
                              f"optimizer such as AdamW or SGD.")
    return tuple(keys), step_dtype


def zero_state_is_initial(cls, kwargs: dict, keys: tuple, step_dtype) -> bool:
    """Whether ``cls`` stepping from state it is handed -- every per-element key zeros, ``step`` 0 -- takes
    exactly the steps it takes from the state it would create itself (Adam(W): yes; SGD with dampening: no,
    its first step copies the gradient). Checked on a probe, so the flat buffers can hold the state from the
    start instead of torch allocating a whole second copy on the first step."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(8, generator=g) for _ in range(3)]
    start = torch.randn(8, generator=g)
    runs = []
    for prefill in (False, True):
        p = start.clone()
        opt = cls([p], **kwargs, foreach=False)
        if prefill:
            if opt.state.get(p):  # state made at construction (Adagrad): already the initial state
                return False
            opt.state[p] = {key: torch.zeros_like(p) for key in keys}
            if step_dtype is not None:
                opt.state[p]["step"] = torch.tensor(0.0, dtype=step_dtype)
        for grad in grads:
            p.grad = grad.clone()
            opt.step()
        runs.append(p)
    return torch.equal(runs[0], runs[1])


def _implementation(cls, implementation: str, device: torch.device) -> list:
    """Keyword sets to try in order for ``implementation``."""
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    fused = [{"fused": True}] if "fused" in accepted else []
    if implementation == "fused":
        return fused or [{"foreach": True}]
    if implementation == "foreach":
        return [{"foreach": True}]
    if implementation == "for-loop":
        return [{"foreach": False}]
    return fused + [{"foreach": True}]


class FlatOptimizer:
    def __init__(self, pieces: Sequence[Piece], shard_numel: int, state_device, config: OptimizerConfig,
                 sub_group_size: int, groups: Sequence = (), pin_memory: bool = False,
                 scratch: Optional[Fp32Scratch] = None, scratch_bytes: Optional[int] = None, arena=None,
                 non_blocking: bool = False, swap_path=None):
        self.config = config
        self.weight_decays = [g.weight_decay for g in groups] or [config.weight_decay]
        self.cls = config.torch_class
        self.kwargs = config.torch_kwargs()
        self.keys, self._step_dtype = probe_state(self.cls, self.kwargs)
        self._prefill = zero_state_is_initial(self.cls, self.kwargs, self.keys, self._step_dtype)
        self.state_device = torch.device(state_device)
        self.pieces = list(pieces)
        fp32_grads = all(p.grad.dtype == torch.float32 for p in self.pieces)
        # the rule of the device the kernels run on (hybrid.plan.layout.step_rule); with NVMe its batches are
        # the swap file's records
        self.rule = step_rule(self.state_device.type, fp32_grads, sub_group_size, scratch_bytes)
        self.sub_group_size = self.rule.batch_numel
        self.step_count = 0
        self.lag: dict = {}  # parameter index -> steps it was skipped (no gradient): its torch step count lags
        self.batches = self._build_batches()
        self.scratch = scratch or Fp32Scratch()  # fp32 staging of non-fp32 gradients, one batch at a time
        self._largest_batch = max((b.numel for b in self.batches), default=0)
        self.swap = None  # NVMe: the swap store holding the masters and the state, one record per batch
        if swap_path is not None:
            from hybrid.zero.nvme import SwapStore

            self.buffers = {}
            self.swap = SwapStore(swap_path, [b.numel for b in self.batches], (MASTER, *self.keys),
                                  pin_memory=pin_memory)
            self._segments = sorted((piece.pos + lo, g, at, hi - lo) for g, b in enumerate(self.batches)
                                    for at, (_, piece, lo, hi) in zip(b.starts, b.views))
            self._segment_starts = [s[0] for s in self._segments]
        elif arena is not None:
            self.buffers = {key: arena.take(shard_numel, torch.float32) for key in self.keys}
        else:
            self.buffers = {key: _zeros(shard_numel, self.state_device, pin_memory) for key in self.keys}
        # write-back from pinned host memory to the device (not from a swap record: its buffer is reused)
        self.non_blocking = non_blocking and self.swap is None
        self._written = None  # CUDA event after the last non-blocking write-back
        self._adopt_all()  # classes that create state at construction (Adagrad)
        if self._prefill and self.swap is None:
            self._point_state()

    # -- construction ---------------------------------------------------------------------------------
    def _cut(self):
        """``(piece, lo, hi)`` sub-pieces of at most ``sub_group_size`` elements, in shard order."""
        for piece in self.pieces:
            n = piece.master.numel()
            for lo in range(0, n, self.sub_group_size):
                yield piece, lo, min(n, lo + self.sub_group_size)

    def _build_batches(self) -> list:
        items = list(self._cut())
        groups = bucket_groups([hi - lo for _, lo, hi in items], range(len(items)), self.sub_group_size)
        return [self._batch([items[k] for k in group]) for group in groups]

    def _batch(self, items: list) -> "_Batch":
        views, by_group, starts, at = [], {}, [], 0
        for piece, lo, hi in items:
            view = piece.master[lo:hi]
            views.append((view, piece, lo, hi))
            starts.append(at)
            at += hi - lo
            by_group.setdefault(piece.group, []).append(view)
        groups = sorted(by_group)
        def param_groups():
            return [{"params": by_group[g], "weight_decay": self.weight_decays[g]} for g in groups]

        opt, errors = None, []
        for impl in _implementation(self.cls, self.config.implementation, self.state_device):
            try:
                opt = self.cls(param_groups(), **self.kwargs, **impl)
                self.fused = bool(impl.get("fused"))
                break
            except (RuntimeError, ValueError) as exc:  # e.g. no fused kernel for this device
                errors.append(exc)
        if opt is None:
            raise errors[-1]
        return _Batch(opt, groups, views, starts, at)

    def _adopt_all(self) -> None:
        if not any(batch.opt.state for batch in self.batches):
            return
        if self.swap is None:
            for batch in self.batches:
                self._adopt(batch)
            return
        with contextlib.closing(self.swap.sweep(write=True)) as records:
            for g, record in records:
                self._adopt(self.batches[g], record)

    # -- where the masters and the state are ----------------------------------------------------------
    def _placed(self, write: bool = False, read: bool = True) -> Iterator[tuple]:
        """``(batch, record)`` for every batch in order: ``record`` None where the masters and the state are in
        memory (the pieces' views and ``buffers``); with NVMe, the batch's record of the swap file (its fields'
        views, in a host buffer: the batch's views are bound to them first), the next record being read and the
        previous one written meanwhile; ``write``: the records go back to the file."""
        if self.swap is None:
            for batch in self.batches:
                yield batch, None
            return
        with contextlib.closing(self.swap.sweep(read=read, write=write)) as records:
            for g, record in records:
                batch = self.batches[g]
                self._bind(batch, record)
                yield batch, record

    def _bind(self, batch: "_Batch", record: dict) -> None:
        """NVMe: point the batch's views and their torch state at its record (``steps_taken`` of them before)."""
        master = record[MASTER]
        for at, (view, piece, lo, hi) in zip(batch.starts, batch.views):
            view.data = master[at:at + hi - lo]
            state = batch.opt.state.get(view)
            if not state and not (self._prefill or self.step_count > self._pending):
                continue  # torch makes the state on this first step (adopted into the record after it)
            state = batch.opt.state[view]
            for key in self.keys:
                state[key] = record[key][at:at + hi - lo]
            if self._step_dtype is not None and "step" not in state:
                state["step"] = self._step_tensor(view, self.step_count - self._pending - self.lag.get(piece.param, 0))

    def _slice(self, key: str, batch: "_Batch", k: int, record: Optional[dict]) -> torch.Tensor:
        """Where the state ``key`` of the batch's ``k``-th view lives: ``buffers`` or its record."""
        view, piece, lo, hi = batch.views[k]
        if record is None:
            return self.buffers[key][piece.pos + lo:piece.pos + hi]
        return record[key][batch.starts[k]:batch.starts[k] + hi - lo]

    def _step_tensor(self, view: torch.Tensor, steps: int) -> torch.Tensor:
        where = view.device if self.fused else torch.device("cpu")
        return torch.tensor(float(steps), dtype=self._step_dtype, device=where)

    # -- stepping -------------------------------------------------------------------------------------
    _pending = 0  # 1 while a step is being taken (step_count already counts it)

    @torch.no_grad()
    def step(self, lrs: Sequence[float], grad_scale: Optional[torch.Tensor] = None, skip: frozenset = frozenset()
             ) -> None:
        """One step of every piece; group ``g`` uses learning rate ``lrs[g]``; ``grad_scale`` (0-dim fp32)
        multiplies the gradients first; the pieces of the parameters in ``skip`` (no gradient anywhere this
        step) are left as torch's optimizers leave a parameter whose ``grad`` is None: not stepped, no decay,
        their state and per-parameter step count untouched. Each batch costs a constant number of calls whatever
        its size: one conversion of its non-fp32 gradients, one scaling, the optimizer's own (one fused or
        foreach call per parameter group) and one write-back."""
        self.step_count += 1
        self.wait_writeback()
        self._pending = 1
        if grad_scale is not None:
            grad_scale = grad_scale.to(self.state_device)
        try:
            for batch, record in self._placed(write=True):
                self._step_batch(batch, record, lrs, grad_scale, skip)
        finally:
            self._pending = 0
        for i in skip:
            self.lag[i] = self.lag.get(i, 0) + 1
        if self.non_blocking:
            self._written = torch.cuda.Event()
            self._written.record()
        if not self.rule.keep_scratch:  # a batch-long device buffer: back to the allocator's cache
            self.scratch.release(self.state_device)

    def _step_batch(self, batch: "_Batch", record: Optional[dict], lrs: Sequence[float],
                    grad_scale: Optional[torch.Tensor], skip: frozenset = frozenset()) -> None:
        for g, group in zip(batch.groups, batch.opt.param_groups):
            group["lr"] = lrs[g]
        pairs, at = [], 0  # (the fp32 gradient the optimizer reads, the gradient converted into it or None)
        for view, piece, lo, hi in batch.views:
            grad = piece.grad[lo:hi]
            if grad.dtype != torch.float32:
                pairs.append((self._staging(at, hi - lo).view_as(grad), grad))
                at += hi - lo
            else:
                pairs.append((grad, None))
        grads = [grad for grad, _ in pairs]
        # In place: the reduced gradient is zeroed right after the step, so no copy is needed.
        if self.rule.per_piece:  # CPU: a piece is scaled right after its conversion, while in cache
            for grad, source in pairs:
                if source is not None:
                    grad.copy_(source)
                if grad_scale is not None:
                    grad.mul_(grad_scale)
        else:
            converted = [(grad, source) for grad, source in pairs if source is not None]
            if converted:
                torch._foreach_copy_([grad for grad, _ in converted], [source for _, source in converted])
            if grad_scale is not None and grads:
                torch._foreach_mul_(grads, grad_scale)
        for (view, piece, _, _), grad in zip(batch.views, grads):
            view.grad = None if piece.param in skip else grad
        batch.opt.step()
        outs, masters = [], []
        for view, piece, lo, hi in batch.views:
            view.grad = None
            if piece.out is not None:
                outs.append(piece.out[lo:hi])
                masters.append(view)
        if outs and outs[0].device == masters[0].device:
            torch._foreach_copy_(outs, masters)
        else:  # offload: host master -> device parameters, piece by piece (non-blocking from pinned memory)
            for out, master in zip(outs, masters):
                out.copy_(master, non_blocking=self.non_blocking)
        self._adopt(batch, record)

    def wait_writeback(self) -> None:
        """Block until the last step's non-blocking copies out of the host master have run (before the host
        writes the master again: the next step, a checkpoint load)."""
        if self._written is not None:
            self._written.synchronize()
            self._written = None

    def _staging(self, at: int, n: int) -> torch.Tensor:
        """Elements ``[at, at + n)`` of the reused fp32 scratch (one batch long)."""
        return self.scratch.view(self._largest_batch, self.state_device)[at:at + n]

    def _adopt(self, batch: "_Batch", record: Optional[dict] = None) -> None:
        """Move state torch created for a piece into the flat buffers (or its record), and point the piece's
        state there."""
        for k, (view, piece, lo, hi) in enumerate(batch.views):
            state = batch.opt.state.get(view)
            if not state:
                continue
            for key in self.keys:
                value = state.get(key)
                flat = self._slice(key, batch, k, record)
                if value is not None and value.data_ptr() != flat.data_ptr():
                    flat.copy_(value)
                    state[key] = flat

    @torch.no_grad()
    def restore(self, step_count: int, lag: Optional[dict] = None) -> None:
        """After the buffers were loaded: this many steps were taken (``lag``: parameter index -> the steps of
        them it was skipped); point every piece's state at them."""
        self.step_count = int(step_count)
        if lag is not None:
            self.lag = {int(i): int(n) for i, n in lag.items() if n}
        if self.swap is not None:  # the state is re-pointed at each record as it is stepped
            for batch in self.batches:
                batch.opt.state.clear()
        elif self.step_count or self._prefill:  # else torch makes the state on the first step, as before
            self._point_state()

    def _point_state(self) -> None:
        """Every piece's torch state is its views of the flat buffers, at ``step_count``."""
        for batch in self.batches:
            for k, (view, piece, lo, hi) in enumerate(batch.views):
                state = {key: self._slice(key, batch, k, None) for key in self.keys}
                if self._step_dtype is not None:
                    state["step"] = self._step_tensor(view, self.step_count - self.lag.get(piece.param, 0))
                batch.opt.state[view] = state

    @torch.no_grad()
    def copy_master_to_params(self) -> None:
        self.wait_writeback()
        for batch, _ in self._placed():
            for view, piece, lo, hi in batch.views:
                if piece.out is not None:
                    piece.out[lo:hi].copy_(view)

    # -- NVMe: element ranges of the shard (the first values, checkpoints) -----------------------------
    def _runs(self, pos: int, n: int) -> Iterator[tuple]:
        """``(record, offset in it, offset in [pos, pos + n), count)`` of the shard's elements
        ``[pos, pos + n)`` that pieces own (padding has no record)."""
        k = max(bisect.bisect_right(self._segment_starts, pos) - 1, 0)
        end = pos + n
        for lo, g, at, count in self._segments[k:]:
            if lo >= end:
                break
            a, b = max(lo, pos), min(lo + count, end)
            if a < b:
                yield g, at + a - lo, a - pos, b - a

    def read_shard(self, key: str, pos: int, n: int) -> torch.Tensor:
        """NVMe: a host copy of elements ``[pos, pos + n)`` of ``key`` (``master`` or a state key) in shard
        space, zeros where nothing is stored (padding)."""
        out = torch.zeros(n, dtype=torch.float32)
        for g, at, i, count in self._runs(pos, n):
            self.swap.read_range(g, key, at, out[i:i + count])
        return out

    def write_shard(self, key: str, pos: int, values: torch.Tensor) -> None:
        """NVMe: store ``values`` as elements ``[pos, pos + n)`` of ``key`` in shard space (padding dropped)."""
        values = values.detach().to(device="cpu", dtype=torch.float32).contiguous()
        for g, at, i, count in self._runs(pos, values.numel()):
            self.swap.write_range(g, key, at, values[i:i + count])

    def tensors(self) -> list:
        """The host (or device) tensors behind the masters and the state: the buffers, or with NVMe the swap
        store's record buffers (the masters in memory are the pieces', counted by their owner)."""
        return self.swap.tensors() if self.swap is not None else list(self.buffers.values())

    def close(self) -> None:
        """Remove the swap file (NVMe); the optimizer cannot step after it."""
        if self.swap is not None:
            self.swap.close()


@dataclass(frozen=True)
class SwappedRange:
    """NVMe: elements ``[pos, pos + n)`` of ``key`` (``master`` or a state key) in shard space, in the swap file:
    what a checkpoint saves (``read``, a host copy) and fills (``write``) without holding the shard."""

    optimizer: "FlatOptimizer"
    key: str
    pos: int
    n: int
    dtype = torch.float32

    def numel(self) -> int:
        return self.n

    def read(self) -> torch.Tensor:
        return self.optimizer.read_shard(self.key, self.pos, self.n)

    def write(self, lo: int, values: torch.Tensor) -> None:
        self.optimizer.write_shard(self.key, self.pos + lo, values)


@dataclass
class _Batch:
    opt: torch.optim.Optimizer
    groups: list      # parameter-group index of each of opt.param_groups
    views: list       # (master view, piece, lo, hi)
    starts: list      # where each view starts in the batch (its offset in the batch's NVMe record)
    numel: int        # elements of all its views


def _zeros(n: int, device: torch.device, pin_memory: bool) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32, device=device, pin_memory=pin_memory and device.type == "cpu")
