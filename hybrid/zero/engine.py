"""ZeroEngine: ZeRO stages 0-3 on a data-parallel group, as policies over shared pieces.

The pieces: a flat layout of the trainable parameters cut into units (``hybrid.plan.layout``), the rank's
flat buffers with the parameters re-bound as views (``state``), gradient buckets reduced during backward
(``buckets``), parameter gathering (``params``), the optimizer on the fp32 shard (``optimizer``: any
elementwise ``torch.optim`` class, parameter groups from ``param_groups``, the learning rate of each step
from ``hybrid.config.schedule``) and the global gradient norm (``clip``). What the engine refuses and notes
is in ``checks``, DeepSpeed's names for its methods in ``deepspeed_api``, what it reads of tensor
parallelism in ``tp_interface``. A stage only chooses which buffers are sharded and which collective moves
them (``hybrid.config.stage_policy``):

* stage 0: units are buckets of ``reduce_bucket_size``; each is all-reduced in backward (2Ψ per step).
* stage 1: the same buckets are reduce-scattered in backward (Ψ); after the step every rank all-gathers
  the updated parameters (Ψ).
* stage 2: as stage 1, but the gradients are reduce-scattered bucket by bucket at every micro-step and only
  the shard is kept.
* stage 3: units follow the module tree (``zero.stage3_unit``, ``hybrid.zero.units``: by default one per
  block of every ``ModuleList``/``Sequential`` plus one for the rest, and one for the persistent
  parameters); a unit is all-gathered before its root's forward and backward (2Ψ) and its gradients
  reduce-scattered (Ψ); only the persistent parameters are all-gathered after the step (instead of twice
  per step).

(Ψ = bytes of the padded model-dtype parameters; all-reduce counts 2Ψ, as in ``hybrid.comm``. At stages
1-3 the two partial sums of the gradient norm add one 16-byte all-reduce per step.)

Semantics, equal to single-process training on the global batch with the configured ``torch.optim`` class
(AdamW by default) over ``param_groups.torch_param_groups(model, config.optimizer)``, its learning rate
set before each step as the configured schedule says (``engine.lr``: the latest step's):

* Frozen parameters (``requires_grad=False``) stay plain replicated tensors; a parameter registered twice
  (tied weights) is one parameter. Every parameter and buffer not built on meta is broadcast from DP rank 0
  at ``initialize`` (meta-built ones are drawn alike on every rank), then the traffic counters are reset.
* ``engine.backward(loss)`` back-propagates ``loss / gradient_accumulation_steps``; gradients are summed
  over the micro-steps and averaged over the DP ranks (inside the collective on NCCL; on other backends
  the backward also divides by the DP size and the collective sums). So with equal per-rank micro-batches and ``loss``
  the mean over the rank's micro-batch, the gradients are those of the mean loss over the global batch.
  Stages 0 and 1 communicate once per optimizer step (at the last micro-step); stages 2 and 3
  reduce-scatter at every micro-step (so only the gradient shard is kept), which multiplies their
  gradient traffic by the number of micro-steps.
* ``engine.step()`` counts micro-steps and, at each accumulation boundary, computes the global gradient
  norm (``last_grad_norm``, before clipping), clips like ``clip_grad_norm_`` when ``gradient_clipping`` is
  set, steps AdamW on this rank's shard, refreshes the parameters and zeroes the gradients; it returns
  True then and False on the other micro-steps. A parameter that received no gradient in a step is
  stepped with a zero gradient (as with ``zero_grad(set_to_none=False)``). At each boundary the module's
  persistent buffers are broadcast from DP rank 0 (``_sync_buffers``; DDP does it before every forward); a
  ``step()`` with no ``engine.backward`` since the last one raises (a plain ``loss.backward()`` would bypass
  the reduction).
* bf16: the model's parameters are bf16, master weights and moments fp32; gradients are summed over DP and
  accumulated over micro-steps in ``zero.reduce_dtype`` (default bf16, the seed's bytes; fp32 as torchtitan
  and Megatron do: autograd's bf16 gradient is added into fp32 buffers by the post-accumulate hook).
  Floating-point tensors given to the engine's forward (at any depth of its arguments) are cast to bf16, as
  FSDP's ``cast_forward_inputs`` does; integer ones (token ids, indices) are left as they are.
  fp32: the fp32 parameters are the master weights (no second copy).
* ``zero.offload_optimizer.device: cpu`` (stages 1-3): the fp32 master and the optimizer state live in host
  memory, views of one host arena per rank of the memory model's host figure (``host_arena``); each unit's
  reduced gradient shard is copied to the host as soon as it is reduced (on CUDA on a side stream,
  non-blocking into pinned memory), the optimizer steps there with the rank's share of the node's cores
  (``host_threads``) and the updated values are copied back into the device's parameter shard in the model
  dtype (non-blocking from pinned memory). The result is that of the same stage
  without offload (bit for bit where host and device run the same kernels, as on a CPU-only machine).
* ``zero.offload_optimizer: {device: nvme, path: DIR}`` (stages 1-3): as with ``cpu``, but the fp32 master and
  the optimizer state live in one swap file per rank under ``DIR`` (``hybrid.zero.nvme``), one record per
  optimizer batch (``hybrid.plan.layout.step_rule`` of the host: at most ``sub_group_size`` elements, and
  ``CONVERT_NUMEL`` with non-fp32 gradients): the step reads a record into a host buffer, steps it with the
  same kernels and the same host threads and writes it back while the next is read (``FlatOptimizer``), so
  host memory holds the gradient shard's copy (the host arena, nothing else in it) and three records, not the
  states. Bit for bit the result of ``cpu`` (the same batches);
  checkpoints read and fill the file a parameter piece at a time (so one taken with either resumes with the
  other); a disk error is ``SwapError`` (a ``JobError``: exit 1; the checkpoints keep their own files).
  ``engine.close()`` removes the file (so do garbage collection and the process's exit).

A parameter no micro-step of an optimizer step gave a gradient on any DP rank (an unused module) is not stepped
at all, as torch's optimizers skip a ``grad`` of None: no weight decay, its moments untouched
(``hybrid.zero.presence``).

Gradients: after ``engine.step()`` every ``param.grad`` is None (as after torch's ``zero_grad()``); after
``engine.backward`` they are views of the flat gradient at stage 0 (reduced at an accumulation boundary) and
at stage 1 between boundaries (this rank's own sums, as under DDP's ``no_sync``), and None after a
boundary's backward at stage 1 and always at stages 2-3 (only the shard is reduced, so ``param.grad`` would
hold unreduced values): clip with ``gradient_clipping`` and read the norm from ``last_grad_norm``, never
``clip_grad_norm_`` over ``module.parameters()``.

Rules: call ``engine.backward`` (not ``loss.backward``) and then ``engine.step`` once per micro-step. At
stage 3 every DP rank must run the same modules in the same order (each gather is a collective). A unit
root's forward may read any parameter of its subtree, however it reads it; a parameter read by a tensor op
outside every running unit (a tied head reading a child root's weight) is gathered on demand, logged once
and counted (``gather_report()``), and a parameter autograd saved gathers its unit again when backward
unpacks it (``hybrid.zero.params``); outside the forward a released parameter is an empty tensor. Read weights through ``full_state_dict()`` (a collective
at stages 1-3) or ``shard_views()``; ``engine.shapes`` holds the parameters' shapes.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from hybrid.config import validate as v
from hybrid.comm.collectives import Comm
from hybrid.comm.zero_groups import ZeroGroups
from hybrid.errors import ConfigError, UsageError
from hybrid.config.training import TrainConfig
from hybrid.config.schedule import lr_at
from hybrid.config.stage_policy import policy_for
from hybrid.plan.layout import align_elements, host_arena_bytes, stage_layout, step_rule
from hybrid.weights.sources import ValueSources, has_meta
from hybrid.weights.attrs import gather_tp_tensor, is_tensor_parallel, tensor_parallel_dim
from hybrid.weights.state_entries import BUFFER, EXTRA, PARAM, exported, state_dict_entries
from hybrid.zero import checks
from hybrid.zero.buckets import GradReducer
from hybrid.zero.clip import NonFiniteGuard, clip_coefficient, global_grad_norm
from hybrid.zero.construct import materialize, resolve_device
from hybrid.zero.deepspeed_api import DeepSpeedNames
from hybrid.zero.host_arena import HostArena
from hybrid.zero.host_threads import host_optimizer_threads, intra_op_threads, node_cores, ranks_on_node
from hybrid.zero.presence import GradPresence
from hybrid.zero.optimizer import MASTER, FlatOptimizer, SwappedRange, probe_state
from hybrid.zero.param_groups import assign as assign_groups, embedding_names
from hybrid.zero.params import ParamGatherer, all_gather_units
from hybrid.zero.units import plan_units
from hybrid.zero.state import FlatState

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class ShardView:
    """The part ``[start, end)`` of a parameter's flattened elements this DP rank owns, with writable views."""

    shape: tuple
    numel: int
    start: int
    end: int
    master: torch.Tensor  # with NVMe offload: a ``SwappedRange`` of the swap file (and so are the states)
    states: dict  # optimizer state key (exp_avg, momentum_buffer, ...) -> writable view

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.states["exp_avg"]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.states["exp_avg_sq"]


class ZeroEngine(DeepSpeedNames):
    def __init__(self, module: nn.Module, config: TrainConfig, dp_group=None, tp_group=None, *, seed: int = 0,
                 init_fn=None, weights=None, device=None):
        self.module, self.config = module, config
        zero = config.zero
        self.stage = zero.stage
        self.policy = policy_for(self.stage)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no trainable parameters (requires_grad=True)")
        self.device = resolve_device([p for _, p in named], device)
        # the DP group, the shard groups the options cut it into, and their collectives (hybrid.comm.zero_groups)
        self.zero_groups = ZeroGroups.build(dp_group, zero, self.policy, self.device)
        self.dp_comm = self.zero_groups.dp
        self.presence = GradPresence(self.dp_comm)
        self.tp_comm = Comm(tp_group, "tp") if tp_group is not None else None
        self.config = config = config.check_batch(self.dp_comm.size)  # derives accumulation not given
        self.dtype = DTYPES[config.precision]
        checks.refuse_complex(named)
        checks.note_cast(module, self.dtype)
        model_dtypes = {p.dtype for _, p in named if p.is_floating_point()}
        checks.refuse_sparse_gradients(module)
        checks.refuse_compiled_with_unit_hooks(module, self.policy)
        checks.refuse_model_of_a_stage3_engine(module)
        checks.check_tp_degree(module, self.tp_comm)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [tuple(p.shape) for p in self.params]  # stage 3 empties released parameters
        self._index = {id(p): i for i, p in enumerate(self.params)}
        checks.note_slow_bf16(self.device, self.dtype)
        tp_rank, tp = (self.tp_comm.rank, self.tp_comm.size) if self.tp_comm is not None else (0, 1)
        # Weights are checked (names, shapes) before anything is allocated.
        sources = ValueSources(module, seed=seed, init_fn=init_fn, weights=weights, tp_rank=tp_rank, tp=tp)
        meta = has_meta(module)
        self.optimizer = None
        try:
            if sources.weights is None:  # a tensor built off meta is taken as it is: DP rank 0's on every rank
                self._broadcast_from_rank0()
            self.layout, order, persistent = self._layout()
            offload = zero.offload_optimizer
            grad_dtype = DTYPES[config.grad_precision]
            arena = self._host_arena(grad_dtype) if offload.enabled else None
            self.state = FlatState(self.layout, self.policy, self.zero_groups.position, self.dtype, self.device,
                                   frozenset(persistent), host="cpu" if offload.enabled else None,
                                   pin_memory=offload.pin_memory, grad_dtype=grad_dtype, arena=arena,
                                   nvme=offload.nvme)
            # With NVMe the optimizer comes before the values: its swap file takes the masters as they are
            # written. Otherwise after them (below), its buffers not on top of a weights file's mapped pages.
            if offload.nvme:
                self._build_optimizer(offload)
                self.state.master_sink = partial(self.optimizer.write_shard, MASTER)
            views, transient = materialize(self.module, self.params, self.shapes, self.state, sources,
                                           self.device)
        except BaseException:
            if self.optimizer is not None:
                self.optimizer.close()  # NVMe: its swap file goes at once
            raise
        finally:
            sources.close()
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._cast_frozen_and_buffers(model_dtypes)
        # the frozen parameters as they are now (building on meta and casting replace the objects)
        self._frozen = [(n, p) for n, p in module.named_parameters() if id(p) not in self._index]
        if self.optimizer is None:
            self._build_optimizer(offload)
        # offload (cpu or nvme): the host step's threads, the rank's share of its node's cores (or as configured)
        self.host_threads = (host_optimizer_threads(offload.threads, node_cores(), ranks_on_node())
                             if offload.enabled else None)
        self.base_lr = config.optimizer.lr
        self.persistent_units = persistent
        self.gatherer = None
        if self.policy.shard_params:
            self.gatherer = ParamGatherer(self.zero_groups.params, self.layout, self.state.unit_full,
                                          self.state.unit_param_shard, persistent, self._module_units(persistent),
                                          zero.prefetch_bucket_size, views,
                                          names={id(p): n for p, n in zip(self.params, self.names)}, owner=self,
                                          check_comm=self.dp_comm, secondary=self.zero_groups.secondary)
        self.reducer = GradReducer(
            self.zero_groups.grads, self.layout, self.params, self.policy.grad_mode, order,
            flat_grad=self.state.flat_grad, replicas=self.zero_groups.replicas,
            grad_shard=self.state.grad_shard, use_reduce_scatter=zero.reduce_scatter, overlap=zero.overlap_comm,
            max_inflight_numel=zero.reduce_bucket_size,
            on_unit_done=self.gatherer.release_after_backward if self.gatherer else None,
            on_unit_reduced=self._grad_reduced if self.state.host_grad is not None else None)
        self._on_host = set()  # offload: units whose reduced gradient shard is (being) copied to the host
        self._norm_runs = self._grad_norm_runs()
        self._norm_rule = step_rule(self.device.type, False, zero.sub_group_size)  # the norm reads the device's grads
        held = self.memory_report()
        states = held["params"] + held["grads"] + held["optimizer"]
        # What construction held at its peak: the final states plus the largest transient on the way.
        self.init_report = {"source": "weights" if weights is not None else "init" if meta else "model",
                            "model_state_bytes": states, "largest_transient_bytes": transient,
                            "peak_bytes": states + transient}
        self.micro_steps = 0
        self.last_lr = None
        self._awaiting_step = False
        self._broken = ""  # why the engine cannot go on (a backward that raised partway), or ""
        self.global_step = 0
        self.last_grad_norm = None
        self.nonfinite = NonFiniteGuard(config.max_nonfinite_skips)
        self.reset_comm()

    # -- construction ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Every tensor not on meta (all of them for a model built the ordinary way; a module a meta-built
        model builds off meta) as DP rank 0 holds it: ranks seeded apart would otherwise start apart."""
        tensors = list(self.module.parameters()) + list(self.module.buffers())
        meta = torch.tensor([t.is_meta for t in tensors], dtype=torch.float32, device=self.device)
        if not torch.equal(*self.dp_comm.extremes(meta)):  # else the broadcasts below would pair wrongly
            raise ConfigError("the DP ranks built the model differently (some tensors are on meta on some "
                              "ranks and real on others, e.g. weights loaded on rank 0 only): build it the same "
                              "way on every rank (on meta everywhere, with weights= naming the file to load)")
        for t in tensors:
            if not t.is_meta:
                self.dp_comm.broadcast(t.data)

    def _host_arena(self, grad_dtype: torch.dtype) -> HostArena:
        """Offload: the rank's one host allocation, sized by the memory model's rule for this shard (with NVMe
        the gradient copy alone: the master and the state are in the swap file)."""
        opt, offload = self.config.optimizer, self.config.zero.offload_optimizer
        keys, _ = probe_state(opt.torch_class, opt.torch_kwargs())
        nbytes = host_arena_bytes(self.layout.shard_numel, torch.empty((), dtype=grad_dtype).element_size(), len(keys),
                                  nvme=offload.nvme)
        pin = offload.pin_memory and self.device.type == "cuda"
        return HostArena(nbytes, pin=pin)

    def _scratch_budget(self):
        """Bytes the optimizer's fp32 gradient scratch may take on a GPU: half the device memory free once the
        model states are allocated (the step runs after backward has freed the activations); None elsewhere."""
        if self.device.type != "cuda" or self.state.host is not None:
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return free // 2

    def _layout(self) -> tuple:
        """(FlatLayout, reduce order of units, persistent unit indices) for this stage."""
        zero = self.config.zero
        unit_params = None
        if self.policy.module_units:
            self._unit_plans = plan_units(self.module, zero.stage3_unit, self._index)
            unit_params = [plan.params for plan in self._unit_plans]
        align = align_elements(torch.empty((), dtype=self.dtype).element_size())
        return stage_layout([p.numel() for p in self.params], unit_params, self.policy, self.zero_groups.shard_size,
                            align,
                            zero.reduce_bucket_size, zero.param_persistence_threshold)

    def _build_optimizer(self, offload) -> None:
        """The parameter groups and the optimizer over this rank's pieces (``self.group_of``, ``self.groups``,
        ``self.optimizer``)."""
        config = self.config
        self.group_of, self.groups = assign_groups(self.names, self.shapes, embedding_names(self.module),
                                                   config.optimizer)
        self.optimizer = FlatOptimizer(self.state.pieces(self.group_of), self.layout.shard_numel,
                                       self.state.master_device, config.optimizer, config.zero.sub_group_size,
                                       self.groups, pin_memory=self.state.pin_memory,
                                       scratch_bytes=self._scratch_budget(), arena=self.state.arena,
                                       non_blocking=self.state.pin_memory, swap_path=self._swap_path(offload))

    def _swap_path(self, offload):
        """NVMe offload: this rank's swap file under ``offload.path`` (``hybrid.zero.nvme.rank_swap_file``)."""
        if not offload.nvme:
            return None
        from hybrid.zero.nvme import rank_swap_file

        return rank_swap_file(offload.path, dist.get_rank() if dist.is_initialized() else 0)

    def _unit_master(self, u: int) -> torch.Tensor:
        """The fp32 master of this rank's part of unit ``u``: its memory, or with NVMe a host copy read from the
        swap file."""
        if self.state.nvme:
            unit = self.layout.units[u]
            return self.optimizer.read_shard(MASTER, unit.shard_offset, unit.shard_numel)
        return self.state.unit_master(u)

    def _module_units(self, persistent: set) -> dict:
        """Unit root -> the non-persistent units holding the parameters registered in its domain."""
        out = {}
        for plan in self._unit_plans:
            units = {self.layout.locate(i)[0].index for i in plan.reads} - persistent
            if units:
                out[plan.root] = tuple(sorted(units))
        return out

    @torch.no_grad()
    def _cast_frozen_and_buffers(self, model_dtypes: set) -> None:
        """Frozen parameters and buffers in the model's own dtype(s) (those of its trainable parameters) follow
        the module into the run's precision, as ``module.to(dtype)`` would take them; one deliberately kept in
        another dtype (an fp64 buffer in an fp32 model, an fp32 table in a bf16 one) stays as it is, as in the
        single-process model."""
        follow = model_dtypes - {self.dtype}
        for p in self.module.parameters():
            if not p.requires_grad and p.dtype in follow:
                p.data = p.data.to(self.dtype)
        cast = {}  # id(buffer) -> its cast: a buffer registered in several modules stays one tensor
        for m in self.module.modules():
            for key, buf in m._buffers.items():
                if buf is not None and buf.dtype in follow:
                    m._buffers[key] = cast.setdefault(id(buf), buf.to(self.dtype))

    def _grad_norm_runs(self) -> list:
        """``(grad view, is_tensor_parallel)`` covering this rank's gradient shard, split where the flag flips."""
        tp = self.tp_comm is not None and not self.tp_comm.solo
        pieces_by_unit = {}
        for piece in self.layout.owned_pieces(self.state.rank):
            pieces_by_unit.setdefault(piece.unit, []).append(piece)
        runs = []
        for unit in self.layout.units:
            grad = self.state.unit_grad_shard(unit.index)
            pieces = pieces_by_unit.get(unit.index, [])
            flags = {tp and is_tensor_parallel(self.params[pc.param]) for pc in pieces}
            if len(flags) <= 1:
                runs.append((grad, flags.pop() if flags else False))
                continue
            lo = unit.shard_range(self.state.rank)[0]
            runs += [(grad[pc.unit_pos - lo:pc.unit_pos - lo + pc.numel], is_tensor_parallel(self.params[pc.param]))
                     for pc in pieces]
        return runs

    # -- training -------------------------------------------------------------------------------------
    def _cast_input(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        return x

    def __call__(self, *args, **kwargs):
        if self.dtype != torch.float32:  # bf16: floating inputs in the module's dtype, as FSDP's cast_forward_inputs
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        if self.gatherer is None:
            return self.module(*args, **kwargs)
        self.gatherer.begin_forward()
        try:
            with self.gatherer.guard():
                return self.module(*args, **kwargs)
        finally:
            self.gatherer.end_forward()

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Back-propagate ``loss / gradient_accumulation_steps`` (and / DP size where the collective cannot
        average) and reduce the gradients of this stage; returns ``loss`` (as DeepSpeed's does)."""
        if self._broken:
            raise UsageError(self._broken)
        if self._awaiting_step:
            raise UsageError("engine.backward() was called twice without engine.step(); call step() after "
                             "every backward (it only steps the optimizer at accumulation boundaries)")
        checks.check_loss(loss)  # before the state changes: a corrected call must still work
        checks.check_trainable_unchanged(self.names, self.params, self._frozen)
        accum = self.config.gradient_accumulation_steps
        boundary = (self.micro_steps + 1) % accum == 0
        self.reducer.begin(reduce=boundary)
        if self.gatherer is not None:
            self.gatherer.begin_backward()
        try:
            divisor = accum * self.reducer.loss_divisor
            (loss / divisor if divisor > 1 else loss).backward()
            self.reducer.finish()
        except BaseException as err:
            # Before any gradient reached the engine (a graph already freed, a bad loss), nothing changed and a
            # corrected call works; after, this rank's gradients are part-accumulated and part-reduced.
            if self.reducer.started():
                self._broken = (f"engine.backward() raised partway through ({type(err).__name__}), after part of "
                                "the gradients had been accumulated or reduced, so they are incomplete on this rank; "
                                "restart from the last checkpoint")
            raise
        finally:
            if self.gatherer is not None:
                self.gatherer.end_backward()
        self._awaiting_step = True
        return loss

    def step(self) -> bool:
        """Count a micro-step; at an accumulation boundary, clip and step the optimizer and return True.

        A NaN/inf global norm skips the update on every rank instead (weights, moments, optimizer_step_count
        and global_step untouched, gradients zeroed; returns False; ``nonfinite.skipped`` counts it), and
        ``max_nonfinite_skips`` of them in a row raise ``NonFiniteError`` (``zero.clip.NonFiniteGuard``).
        """
        if self._broken:
            raise UsageError(self._broken)
        if not self._awaiting_step:
            raise UsageError("engine.step() was called without engine.backward(loss) since the last step "
                             "(loss.backward() bypasses the engine: its gradients are never reduced); call "
                             "engine.backward(loss) before every step()")
        self._awaiting_step = False
        self.micro_steps += 1
        if self.micro_steps % self.config.gradient_accumulation_steps:
            return False
        units_check = self.gatherer.start_units_check() if self.gatherer is not None else None
        self.reducer.fill_if_empty()
        self._sync_buffers()
        norm = global_grad_norm(self._norm_runs, self.zero_groups.exact if self.policy.norm_over_dp else None,
                                self.tp_comm, self.config.zero.sub_group_size, scratch=self.optimizer.scratch,
                                convert_numel=self._norm_rule.norm_convert_numel)
        self.last_grad_norm = float(norm)  # the one host sync of the step: the check's result is there too
        if units_check is not None:
            try:
                self.gatherer.finish_units_check(units_check)
            except UsageError as err:  # this step's gradients mix modules: nothing may be stepped with them
                self._broken = str(err)
                raise
        if self.nonfinite.skip(self.last_grad_norm):  # every rank sees the same norm: all skip together
            self.state.wait_host_grads()  # offload: no copy still in flight on the side stream
            self.reducer.zero_()
            self._on_host.clear()
            return False
        clip = self.config.gradient_clipping
        if self.state.host_grad is not None:
            for u in range(len(self.layout.units)):
                if u not in self._on_host:
                    self.state.copy_grads_to_host(u)
            self._on_host.clear()
            self.state.wait_host_grads()  # the copies (a side stream on CUDA) land before the host reads them
        self.last_lr = self.scheduled_lr(self.optimizer.step_count)
        lrs = [self.last_lr * g.lr_scale for g in self.groups]
        skip = self.presence.skipped(self.reducer.got_grad, self.device)  # no gradient anywhere: as torch, no step
        with intra_op_threads(self.host_threads) if self.host_threads else nullcontext():
            self.optimizer.step(lrs, clip_coefficient(norm, clip) if clip else None, skip)
        self._refresh_params()
        self.reducer.zero_()
        self.global_step += 1
        return True

    def _grad_reduced(self, u: int) -> None:
        """Offload: at the last micro-step, start copying unit ``u``'s reduced gradient shard to the host
        (on a side stream on CUDA, so it overlaps the rest of backward)."""
        if (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0:
            self.state.copy_grads_to_host(u)
            self._on_host.add(u)

    def _sync_buffers(self) -> None:
        """DP rank 0's persistent buffers (BatchNorm running statistics, step counters) to every DP rank at
        each optimizer step, as DDP broadcasts them: every rank's forward updated its own copy from its own
        rows, and rank 0's is the one a checkpoint saves. Non-persistent buffers (caches) stay as they are."""
        if self.dp_comm.solo:
            return
        self.dp_comm.broadcast_many(value for _, kind, value in state_dict_entries(self.module, extra=False)
                                    if kind == BUFFER)

    @torch.no_grad()
    def _refresh_params(self) -> None:
        """Bring the full parameters up to date with the (just updated) shards."""
        if self.policy.refresh == "all":
            units = range(len(self.layout.units))
        elif self.policy.refresh == "persistent":
            units = sorted(self.persistent_units)
        else:
            return
        all_gather_units(self.zero_groups.exact, units, self.state.unit_params, self.state.unit_param_shard,
                         self.config.zero.allgather_bucket_size)

    # -- optimizer state access (checkpoints) ---------------------------------------------------------
    @property
    def optimizer_step_count(self) -> int:
        return self.optimizer.step_count

    @optimizer_step_count.setter
    def optimizer_step_count(self, value: int) -> None:
        self.optimizer.restore(int(value))  # the loaded state buffers are live again from here on

    @property
    def skipped_steps(self) -> dict:
        """Parameter name -> the optimizer steps it got no gradient in and was not stepped (``presence``)."""
        return {self.names[i]: n for i, n in sorted(self.optimizer.lag.items())}

    def restore_optimizer(self, step_count: int, skipped_steps: dict) -> None:
        """After a checkpoint's state was loaded: ``step_count`` steps taken, ``skipped_steps`` (as
        ``skipped_steps`` gives it) of them skipped by some parameters, whose torch step counts lag by as many."""
        index = {name: i for i, name in enumerate(self.names)}
        self.optimizer.restore(int(step_count), {index[n]: k for n, k in skipped_steps.items() if n in index})

    def scheduled_lr(self, i: int) -> float:
        """The learning rate of optimizer step ``i`` (0-based) for a group of ``lr_scale`` 1."""
        sched = self.config.scheduler
        if sched is None:
            return self.base_lr
        return lr_at(sched.type, sched.values, self.base_lr, i, self.config.optimizer.lr)

    @property
    def lr(self) -> float:
        """The learning rate of the latest optimizer step; before the first step, after a resume and right
        after ``engine.lr = x``, the rate the next step will use (group ``lr_scale`` 1)."""
        return self.scheduled_lr(self.optimizer.step_count) if self.last_lr is None else self.last_lr

    @lr.setter
    def lr(self, value: float) -> None:
        """Set the learning rate by hand for the steps to come: it takes ``optimizer.lr``'s place, so a schedule
        keeps its shape, scaled by ``value / optimizer.lr`` (absolute ``warmup_min_lr``/``warmup_max_lr``
        too). ``hybrid.checkpoint`` saves a rate set by hand and a resume restores it."""
        value = v.number("engine.lr", value.item() if isinstance(value, torch.Tensor) and value.numel() == 1
                         else value, 0)
        self.base_lr, self.last_lr = value, None

    def shard_views(self) -> dict:
        """name -> ShardView of the elements this rank owns (possibly none: ``start == end``). With NVMe
        offload the master and the state are ``SwappedRange``s of the swap file (read and written on demand)."""
        self.optimizer.wait_writeback()  # a checkpoint may write the host master next
        out = {}
        for i, name in enumerate(self.names):
            start, end, pos = self.layout.owned_range(i, self.state.rank)
            unit, _ = self.layout.locate(i)
            local, n = pos - unit.shard_offset, end - start
            if self.state.nvme:
                master = SwappedRange(self.optimizer, MASTER, pos, n)
                states = {key: SwappedRange(self.optimizer, key, pos, n) for key in self.optimizer.keys}
            else:
                master = self.state.unit_master(unit.index)[local:local + n]
                states = {key: buf[pos:pos + n] for key, buf in self.optimizer.buffers.items()}
            out[name] = ShardView(self.shapes[i], self.layout.numels[i], start, end, master, states)
        return out

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        """After writing master weights (e.g. loading a checkpoint): refresh the model's parameters."""
        self.optimizer.copy_master_to_params()
        self._refresh_params()

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = False) -> dict:
        """The module's ``state_dict()`` keys -- every parameter and persistent buffer, a tied tensor under each
        of its names (one shared copy, as ``state_dict()`` shares them), so ``load_state_dict(..., strict=True)``
        of the single-process model takes it -- as CPU copies in ``state_entries.exported`` dtypes (fp32, fp64 kept, integers as they are), with
        the single-process shapes at every TP degree (TP slices are gathered over the TP group), identical on
        every rank; with
        ``rank0_only`` only the first rank of the mesh (DP rank 0, TP rank 0) keeps them and the others
        return ``{}``, so one rank, not every rank, holds the whole model in host memory (FSDP's
        ``rank0_only``).

        A collective (the master shards are all-gathered over DP at stages 1-3, one unit at a time, and TP
        slices over TP): call it on every rank.
        """
        tp_rank = self.tp_comm.rank if self.tp_comm is not None else 0
        gather = not rank0_only or self.dp_comm.rank == 0  # a TP group shares its DP rank: all or none gather
        full_by_param = {}
        for unit in self.layout.units:
            master = self._unit_master(unit.index)
            if self.layout.n_shards == 1:
                full = master
            else:
                full = torch.empty(unit.numel, dtype=torch.float32, device=master.device)
                self.zero_groups.exact.all_gather(full, master)
            if not gather:
                continue
            for slot in unit.slots:
                local = full[slot.offset:slot.offset + slot.numel].view(self.shapes[slot.param])
                full_by_param[slot.param] = self._tp_full(local, self.params[slot.param])
            del full  # the unit's gather buffer goes before the next one is made
        entries = list(state_dict_entries(self.module))
        buffers = self._dp_rank0_buffers(entries)  # every rank's, also between accumulation micro-steps
        if not gather:
            return {}
        out, done = {}, {}
        for name, kind, value in entries:
            if kind == EXTRA:  # what the module's get_extra_state() returns, as state_dict() has it
                out[name] = value
                continue
            if id(value) not in done:  # a tied tensor is copied once; its names share the copy
                if kind == PARAM:
                    i = self._index.get(id(value))
                    done[id(value)] = (full_by_param[i] if i is not None
                                       else self._tp_full(exported(value.detach()), value))
                else:  # a persistent buffer
                    done[id(value)] = exported(buffers[id(value)])
            out[name] = done[id(value)]
        return {} if rank0_only and tp_rank != 0 else out

    def _dp_rank0_buffers(self, entries: list) -> dict:
        """id(buffer) -> a CPU copy of DP rank 0's value of every persistent buffer in ``entries``
        (``state_dict_entries``; ranks' buffers differ between accumulation micro-steps: they are broadcast
        at each optimizer step)."""
        copies = {id(b): b.detach().clone() for _, kind, b in entries if kind == BUFFER}
        self.dp_comm.broadcast_many(copies.values(), 0)
        return {key: copy.cpu() for key, copy in copies.items()}

    def _tp_full(self, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``param``'s single-process tensor, from this TP rank's slice ``local``."""
        dim = tensor_parallel_dim(param)
        if dim is None:
            return local.cpu().clone()
        return gather_tp_tensor(local, dim, self.tp_comm).cpu()

    def unsaved_gradients(self) -> Optional[str]:
        """What a checkpoint taken now would lose, or None: a checkpoint holds no gradients, so between a
        backward and its step, or inside an accumulation window, the gradients gathered so far."""
        into = self.micro_steps % self.config.gradient_accumulation_steps
        if self._awaiting_step:
            return "engine.backward() ran without its engine.step(), so its gradients are pending"
        if into:
            return (f"{into} of the {self.config.gradient_accumulation_steps} micro-steps of this optimizer step "
                    "(gradient_accumulation_steps) have run, so their gradients are accumulated but not applied")
        return None

    # -- reports --------------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes of the tensors this rank holds now on its device: params, grads, optimizer (fp32 master +
        optimizer state), buffers (gradient buckets in flight, stage-3 units gathered right now, the
        module's buffers) and scratch (working buffers allocated at the first step, then kept: the fp32
        buffer non-fp32 gradients are converted through for the norm and the optimizer step, the
        receive buffers of gloo's pairwise exchange, ``hybrid.comm``, and stage 2-3 gradient buckets kept
        for the next backward). With the optimizer offloaded, ``host`` says what lives in host memory instead:
        ``{"optimizer": master + state, "grads": the gradient shard's host copy, "scratch": ..., "arena": the one
        host allocation they are views of}`` (device ``optimizer`` is 0); with NVMe ``optimizer`` is the swap
        store's record buffers, the arena holds the gradient copy alone, and ``swap_file`` is the file's bytes."""
        kinds = self.state.tensors()
        offloaded = self.state.host is not None
        kinds["host_optimizer" if offloaded else "optimizer"] += self.optimizer.tensors()
        kinds["params"] += [p for p in self.module.parameters() if not p.requires_grad]
        kinds["buffers"] = self.reducer.transient_tensors() + list(self.module.buffers())
        kinds["scratch"] = (self.optimizer.scratch.tensors(self.device) + self.zero_groups.buffer_tensors()
                            + self.reducer.kept_tensors())
        if self.policy.shard_params:
            kinds["params"] += [self.state.unit_full[u] for u in self.persistent_units]
            if self.gatherer.secondary is not None:  # hpZ's secondary shards
                kinds["params"] += self.gatherer.secondary.tensors()
            kinds["buffers"] += [self.state.unit_full[u] for u in self.gatherer.gathered_units()]
        seen, report = set(), {}
        arena = self.state.arena.tensors()[0].data_ptr() if self.state.arena is not None else None

        def total(tensors) -> int:
            out = 0
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() == arena:  # a view of the host arena: its own bytes
                    if t.data_ptr() not in seen:
                        seen.add(t.data_ptr())
                        out += t.numel() * t.element_size()
                elif storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    out += storage.nbytes()
            return out

        for kind in ("params", "grads", "optimizer", "buffers", "scratch"):
            report[kind] = total(kinds[kind])
        if offloaded:
            report["host"] = {"optimizer": total(kinds["host_optimizer"]), "grads": total(kinds["host_grads"]),
                              "scratch": total(self.optimizer.scratch.tensors(self.state.master_device)),
                              "arena": self.state.arena.nbytes if self.state.arena is not None else 0}
            if self.optimizer.swap is not None:  # NVMe: host "optimizer" is the swap records' buffers
                report["host"]["swap_file"] = self.optimizer.swap.layout.file_bytes
        return report

    def close(self) -> None:
        """Release what outlives the Python objects: with NVMe offload, the swap file (also removed when the
        engine is garbage-collected or the process exits). The engine cannot step after it."""
        self.optimizer.close()

    def comm_report(self) -> dict:
        """Logical bytes moved on the DP group (and the groups the options cut it into) since the last reset, per
        op kind and ``total``, the number of collectives per op kind (``<op>_calls``, ``total_calls``), and the
        bytes by link (``intra``, ``inter``, ``<op>_inter``: ``hybrid.comm.collectives``)."""
        return self.zero_groups.report()

    def quantization_report(self) -> dict:
        """The relative error of the int8 collectives since the last ``reset_comm``: ``weights`` (the values of
        the shards this rank sent in stage 3's all-gathers, as every rank got them back), ``gradients`` (this
        rank's own chunk of the gradient reduce-scatters, as it came back); None where nothing was quantized."""
        return self.zero_groups.quantization_report()

    def quantization_sums(self) -> dict:
        """``quantization_report``'s sums (squared error, squared values: ``hybrid.comm.quantize.QuantError``), so
        that a caller can take the error of any span of steps from two readings."""
        return self.zero_groups.quantization_sums()

    def gather_report(self) -> dict:
        """Stage 3, since the last ``reset_comm``: all-gathers issued in forward and backward (``gathers``), how
        many of them were prefetches, and how many were on-demand reads outside a unit (zeros below stage 3)."""
        counts = self.gatherer.counts if self.gatherer is not None else {}
        return {k: counts.get(k, 0) for k in ("gathers", "prefetches", "on_demand")}

    def reset_comm(self) -> None:
        self.zero_groups.reset()
        self.zero_groups.reset_quantization()
        if self.gatherer is not None:
            self.gatherer.counts.clear()
