"""The implementations under test, behind one small interface.

``setup(impl, stage, model, workload)`` wraps a freshly built fp32 model and returns a ``Runner``:

* ``forward_backward(idx, targets) -> loss`` (a detached fp32 scalar tensor),
* ``optimizer_step()`` (the step plus zeroing/freeing of gradients),
* ``model_state_bytes() -> int``: bytes of parameter, gradient and optimizer-state tensors this rank holds,
* ``traffic() -> dict | None`` and ``reset_traffic()``: logical bytes per collective kind (hybrid only; the
  peers call their collectives from C++ where they cannot be counted).

``world_size(impl, workload)`` is how many ranks a run of ``impl`` spawns: the workload's world size for
hybrid and its peers, 1 for the compute floor.

The compute floor (``floor``) is not a peer but the bound hybrid is measured against: the same per-rank work
in one process with no process group collectives in its step -- the same GPT, rank 0's rows of each step's
batch, the model in the workload precision the way hybrid computes it (fp32: fp32 parameters stepped by
torch.optim.AdamW, fused where the build has the CPU kernel, else foreach; bf16: bf16 module parameters and
gradients, an fp32 master copy stepped by the same AdamW, copied back to bf16: hybrid stage 0's arithmetic
without its all-reduce). It trains on half of every global batch, so its losses are shown but left out of
the agreement check (``math_note``), and it has no traffic. It runs once per workload and precision and
serves every stage (``FLOOR_STAGE`` is only its row key).

Stage 3 shards every parameter in all three implementations: FSDP2 has no replicated "persistent" small
parameters, so hybrid and DeepSpeed run with ``param_persistence_threshold = 0`` (the seed's stage 3:
16Ψ/N bytes of model state, 1.5x the traffic of stage 0). Bucket sizes are the seed's defaults, which are
also DeepSpeed's.

Every implementation runs the same math: AdamW (torch.optim.AdamW for every peer; hybrid's own AdamW on its
fp32 master) with the same hyper-parameters, gradients averaged over the data-parallel ranks, no clipping.

Precision per implementation ("bf16"):

* hybrid      -- bf16 parameters and gradients, fp32 master weights and Adam state (its ``precision="bf16"``).
* ddp, zero1  -- fp32 parameters, gradients and state; forward under ``torch.autocast(bfloat16)``
                 (torch's data-parallel wrappers have no bf16-parameter mode).
* fsdp2       -- fp32 sharded parameters, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``:
                 bf16 unsharded parameters, bf16 gradient reduction, fp32 sharded gradients and state.
* deepspeed   -- ``bf16.enabled``: bf16 module parameters and gradients, fp32 master weights and state.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from bench.workload import Workload

FLOOR = "floor"
FLOOR_STAGE = 0  # the floor has no ZeRO stage; it is stored as stage 0 and compared with every stage

# implementation -> the ZeRO stages it implements
STAGES = {
    "hybrid": (0, 1, 2, 3),
    "ddp": (0,),
    "zero1": (1,),
    "fsdp2": (2, 3),
    "deepspeed": (0, 1, 2, 3),
    FLOOR: (FLOOR_STAGE,),
}
PERSISTENCE_THRESHOLD = 0  # stage 3: shard every parameter, as FSDP2 does
LABELS = {
    "hybrid": "hybrid",
    "ddp": "DDP",
    "zero1": "ZeroRedundancyOptimizer+DDP",
    "fsdp2": "FSDP2 fully_shard",
    "deepspeed": "DeepSpeed ZeRO",
    FLOOR: "compute floor (1 process, no collectives)",
}


# Runs that do the same work per step but start from a different optimizer state, so their losses are
# shown but left out of the agreement check.
MATH_NOTES = {
    ("deepspeed", 0, "bf16"): "DeepSpeed without ZeRO routes bf16 through FP16_UnfusedOptimizer, whose "
                              "initialize_optimizer_states() takes one AdamW step with zero gradients at start-up: "
                              "its step count (bias corrections) and weight decay run one step ahead, so its first "
                              "update is 0.73x lr; left out of the loss check",
}


FLOOR_NOTE = ("one process training rank 0's rows of each batch (1/{world} of the global batch, its gradient "
              "not averaged with the other ranks'), so its losses are those of other batches; left out of the "
              "loss check")


def math_note(impl: str, stage: int, precision: str, world: int) -> str:
    """Why the run ``impl:stage`` at ``precision`` is not expected to match the others' losses ("" if it is)."""
    if impl == FLOOR:
        return FLOOR_NOTE.format(world=world)
    return MATH_NOTES.get((impl, stage, precision), "")


def is_peer(impl: str) -> bool:
    """Whether ``impl`` is one of the implementations hybrid competes with (not hybrid, not the floor)."""
    return impl not in ("hybrid", FLOOR)


def world_size(impl: str, w: Workload) -> int:
    """Ranks a run of ``impl`` spawns: one for the floor, else the workload's data-parallel world."""
    return 1 if impl == FLOOR else w.world_size


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # not installed, or installed without a usable accelerator
        return False
    return True


def import_library(impl: str) -> None:
    """Import what ``impl`` needs, so its import cost is outside the measured training memory."""
    if impl == "deepspeed":
        import deepspeed  # noqa: F401
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
    elif impl == "hybrid":
        import hybrid  # noqa: F401
    elif impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard  # noqa: F401


def setup(impl: str, stage: int, model: torch.nn.Module, w: Workload):
    if stage not in STAGES[impl]:
        raise ValueError(f"{impl} does not implement ZeRO stage {stage}")
    if impl == "hybrid":
        return _HybridRunner(model, stage, w)
    if impl == "deepspeed":
        return _DeepSpeedRunner(model, stage, w)
    if impl == "fsdp2":
        return _fsdp2(model, stage, w)
    if impl == FLOOR:
        return _FloorRunner(model, w)
    return _torch_dp(model, impl, w)


def _adamw(params, w: Workload, **impl) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=w.lr, betas=w.betas, eps=w.eps, weight_decay=w.weight_decay, **impl)


def _fused_adamw(params, w: Workload) -> torch.optim.AdamW:
    """AdamW with the fused kernel where this torch build has it for the parameters' device, else foreach
    (the order hybrid's ``optimizer.implementation: auto`` tries)."""
    params = list(params)
    try:
        return _adamw(params, w, fused=True)
    except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
        return _adamw(params, w, foreach=True)


# --- torch peers ---------------------------------------------------------------------------------

class _Uncounted:
    """Peers issue their collectives from C++: no traffic is counted for them."""

    def traffic(self):
        return None

    def reset_traffic(self):
        pass


class _TorchRunner(_Uncounted):
    def __init__(self, module, wrapped, optimizer, autocast_bf16: bool):
        self.module, self.wrapped, self.optimizer = module, wrapped, optimizer
        self.autocast_bf16 = autocast_bf16

    def forward_backward(self, idx, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast_bf16):
            loss = self.wrapped(idx, targets)
        loss.backward()
        return loss.detach().float()

    def optimizer_step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def model_state_bytes(self) -> int:
        return reachable_tensor_bytes(self.module, self.optimizer)


def _torch_dp(model, impl: str, w: Workload) -> _TorchRunner:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    if impl == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=w.lr,
                                      betas=w.betas, eps=w.eps, weight_decay=w.weight_decay)
    else:
        opt = _adamw(model.parameters(), w)
    return _TorchRunner(model, ddp, opt, autocast_bf16=w.precision == "bf16")


def _fsdp2(model, stage: int, w: Workload) -> _TorchRunner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = dict(mesh=mesh, reshard_after_forward=stage == 3)
    if w.precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    # One FSDP unit per transformer block (every element of a ModuleList), then the root for the rest,
    # as torchtitan does.
    for m in list(model.modules()):
        if isinstance(m, torch.nn.ModuleList):
            for block in m:
                fully_shard(block, **kw)
    fully_shard(model, **kw)
    return _TorchRunner(model, model, _adamw(model.parameters(), w), autocast_bf16=False)


# --- DeepSpeed -----------------------------------------------------------------------------------

class _DeepSpeedRunner(_Uncounted):
    def __init__(self, model, stage: int, w: Workload):
        import deepspeed

        # DeepSpeed's CPU backend JIT-compiles a shared-memory op (30 s) that serves only inference
        # all-reduce; an empty compatibility table skips that build and the compiler probes. Training
        # collectives go through torch.distributed (gloo) either way.
        deepspeed.ops.__compatible_ops__ = {}
        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": w.micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage,
                                  "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD},
            "bf16": {"enabled": w.precision == "bf16"},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=_adamw(model.parameters(), w), config=config)

    def forward_backward(self, idx, targets):
        loss = self.engine(idx, targets)
        self.engine.backward(loss)
        return loss.detach().float()

    def optimizer_step(self):
        self.engine.step()

    def model_state_bytes(self) -> int:
        return reachable_tensor_bytes(self.engine.module, self.optimizer)


# --- the compute floor ---------------------------------------------------------------------------

class _FloorRunner(_TorchRunner):
    """One process, no wrapper and no collectives: forward, backward and AdamW on the model in the workload
    precision (bf16: on an fp32 master copy, the update copied back into the bf16 parameters)."""

    def __init__(self, model, w: Workload):
        self.params = [p for p in model.parameters() if p.requires_grad]
        if w.precision == "bf16":
            with torch.no_grad():
                self.masters = [p.detach().clone() for p in self.params]  # fp32: the model is built in fp32
            model.to(torch.bfloat16)
        else:
            self.masters = None
        super().__init__(model, model, _fused_adamw(self.masters or self.params, w), autocast_bf16=False)

    @torch.no_grad()
    def optimizer_step(self):
        if self.masters is None:
            self.optimizer.step()
        else:
            for master, p in zip(self.masters, self.params):
                master.grad = p.grad.float()
            self.optimizer.step()
            for master, p in zip(self.masters, self.params):
                p.copy_(master)
                master.grad = None
        for p in self.params:
            p.grad = None


# --- hybrid --------------------------------------------------------------------------------------

class _HybridRunner:
    def __init__(self, model, stage: int, w: Workload):
        import hybrid
        from hybrid.config.training import OptimizerConfig, TrainConfig, ZeroConfig

        zero = ZeroConfig(stage=stage, param_persistence_threshold=PERSISTENCE_THRESHOLD)
        config = TrainConfig(zero=zero, precision=w.precision,
                             optimizer=OptimizerConfig(lr=w.lr, betas=tuple(w.betas), eps=w.eps,
                                                       weight_decay=w.weight_decay,
                                                       no_decay="none"))  # the peers decay every parameter
        self.engine = hybrid.initialize(model, config)

    def forward_backward(self, idx, targets):
        loss = self.engine(idx, targets)
        self.engine.backward(loss)
        return loss.detach().float()

    def optimizer_step(self):
        self.engine.step()

    def model_state_bytes(self) -> int:
        report = self.engine.memory_report()  # also has "buffers" (buckets in flight), left out like the peers'
        return int(report["params"] + report["grads"] + report["optimizer"])

    def traffic(self) -> Optional[dict]:
        return dict(self.engine.comm_report())

    def reset_traffic(self):
        self.engine.reset_comm()


# --- counting held tensors -----------------------------------------------------------------------

def reachable_tensor_bytes(module: torch.nn.Module, optimizer) -> int:
    """Bytes of the distinct storages behind the module's parameters and gradients and every tensor
    reachable from the optimizer object (its state, master copies, flat gradient partitions).

    Communication staging buffers are not model state and are left out everywhere: DDP's reducer buckets
    and FSDP2's all-gather/reduce-scatter staging live in C++ out of reach, and DeepSpeed's "ipg" buckets
    (stage 3 preallocates reduce_bucket_size elements, 1 GB in bf16 by default, mostly never touched) are
    skipped by name. What they really cost shows in the peak RSS.
    """
    seen: dict[int, int] = {}
    for p in module.parameters():
        _add(seen, p)
        if p.grad is not None:
            _add(seen, p.grad)
    _walk(optimizer, seen, visited=set(), depth=0)
    return sum(seen.values())


def _add(seen: dict, t: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    if t.device.type == "meta":
        return
    storage = t.untyped_storage()
    if storage.nbytes() > 0:
        seen[storage.data_ptr()] = storage.nbytes()


_LEAVES = (str, bytes, int, float, bool, type(None))


def _walk(obj, seen: dict, visited: set, depth: int) -> None:
    if depth > 8 or isinstance(obj, _LEAVES) or id(obj) in visited:
        return
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        _add(seen, obj)
        if obj.grad is not None:
            _add(seen, obj.grad)
        return
    if isinstance(obj, torch.nn.Module):
        return  # parameters were counted above; do not wander into activations or hooks
    if isinstance(obj, dict):
        children: Iterable = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    elif _is_state_holder(obj):
        children = [v for k, v in vars(obj).items() if "ipg" not in k]
    else:
        return
    for child in children:
        _walk(child, seen, visited, depth + 1)


def _is_state_holder(obj) -> bool:
    """Optimizers and the DeepSpeed objects that hold partitions; nothing else is searched."""
    if isinstance(obj, torch.optim.Optimizer):
        return True
    module = type(obj).__module__ or ""
    return module.startswith("deepspeed.runtime") and hasattr(obj, "__dict__")
