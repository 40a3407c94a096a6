"""Parameter gathering: the post-step all-gather (stages 1-3) and stage 3's gather/release around units.

``all_gather_units`` refreshes full parameters from their updated shards, unit by unit, asynchronously,
with at most ``max_inflight_numel`` elements in flight.

``ParamGatherer`` (stage 3). Each unit owns a full-length buffer whose *storage* is freed (resized to 0
bytes) while the unit is released, so a gather (resize + all-gather from the shards) brings every view of
it back to life in place, including views autograd saved in forward. While released, a parameter's
``.data`` is an empty tensor (shape ``(0,)``, as in DeepSpeed). Units of persistent parameters
(``numel < param_persistence_threshold``) are never released and never gathered in forward/backward.
Which modules are unit roots and which units each reads is ``hybrid.zero.units``' job (``module_units``).

* Forward: a pre-forward hook on every unit root gathers the units its subtree reads and prefetches the
  units of the roots that ran next in the previous forward, up to ``prefetch_numel`` elements; the
  post-forward hook releases them (reference-counted, so nested or repeated use is safe) and hooks the
  root's outputs so that the first gradient reaching them (before the subtree's backward runs) gathers
  the units again, prefetching in the order the previous backward will need them (the reverse of the
  order in which the roots' forwards *returned*, so a root's nested roots come right after it).
* Reads outside every gathered unit: a parameter whose unit is not in use (no running root reads it and
  nothing holds it for backward; released or only prefetched) wears a subclass of its class whose
  ``__torch_function__`` sees the ops that get it (``_released_class``; the parameters in use wear their
  own class again, so the forward's other ops never reach Python). Inside the engine's forward
  (``guard()``), such an op (a parent reading a child root's weight, e.g. a tied head
  ``F.linear(h, self.emb.weight)``) gathers that unit on demand and
  keeps it gathered until its gradients are in (or until the forward ends under ``no_grad``), so the
  value, the saved tensors and the gradient are all right; it is logged once per parameter, naming it,
  and counted (``counts["on_demand"]``) since each such read costs an extra gather.
* Saved parameters (``guard()`` also installs saved-tensor hooks around the forward): a parameter (or a
  view of one) that autograd saves is marked with its unit, and unpacking it in backward makes sure the
  unit is gathered (waiting for an in-flight prefetch, or gathering on demand, logged once per unit and
  counted in ``counts["on_demand"]``). So a backward that reaches a unit's parameters by another route
  than the root's outputs -- an auxiliary loss the block stored, a router's loss, a ``detach``ed read --
  sees full values, never a released or half-gathered buffer.
* Backward: a unit is released as soon as all its parameters have accumulated their gradients
  (``release_after_backward``, called by the gradient reducer), or at ``end_backward``. A forward that
  runs *inside* backward (activation-checkpoint recomputation) only makes sure its units are gathered
  (held to the end of their backward); it neither releases, nor prefetches, nor changes the trace that
  prefetch follows, so a unit gathered for backward is gathered once.

Phases (``Phase``, one explicit state): ``IDLE`` between calls, ``FORWARD`` from ``begin_forward`` to
``end_forward`` (the engine's forward), ``BACKWARD`` from ``begin_backward`` to ``end_backward`` (the
engine's backward; a forward in it is a recomputation). Only IDLE -> FORWARD -> IDLE and IDLE -> BACKWARD ->
IDLE are allowed; any other move is a bug in the engine and raises ``GathererStateError``.

``torch.autograd.Function.apply`` is patched for the process while a stage-3 engine lives
(``FUNCTION_APPLY``): every ``ParamGatherer`` holds the patch for its owner's life (the engine that made it)
and ``close()`` lets it go early; the first holder installs it, the last one gone puts back what was there.

hpZ (``secondary``: a ``SecondaryShards``, ``zero.secondary_shard``): every all-gather outside backward is the
primary one over the shard group (possibly across nodes), and once it has landed this rank keeps its 1/h of the
unit; in backward (also a recomputation's forward) a unit whose secondary shards are this forward's is gathered
from them inside the node instead. ``begin_forward`` forgets them (the parameters may have changed since).

``counts`` holds per-step-resettable tallies: ``gathers`` (all-gathers issued in forward and backward),
``prefetches`` (of those, the ones issued ahead of need) and ``on_demand``.

All DP ranks must run the same modules in the same order (as in every ZeRO-3 implementation), since each
gather is a collective.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import weakref
from collections import Counter, defaultdict
from dataclasses import fields, is_dataclass
from typing import Callable, Mapping, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hybrid.comm.collectives import Comm
from hybrid.errors import UsageError, first_line
from hybrid.plan.layout import FlatLayout

log = logging.getLogger(__name__)
# what every stage-3 mismatch sentence ends with: the rule, and the ways out
SAME_MODULES = ("at stage 3 every DP rank must call the same modules in the same order (run every MoE expert on "
                "every rank, with no rows if none are routed to it), or use ZeRO stage 2")
ORDER_MODULUS = (1 << 20) - 3  # h^2 summed over 1024 ranks stays an exact float64 integer


class Phase(enum.Enum):
    """Where the engine is, as the gatherer sees it."""

    IDLE = "idle"          # between the engine's calls
    FORWARD = "forward"    # inside the engine's forward
    BACKWARD = "backward"  # inside engine.backward: a forward now is an activation-checkpoint recomputation


# The moves the engine makes: a forward or a backward from IDLE, each back to IDLE.
TRANSITIONS = {Phase.IDLE: frozenset({Phase.FORWARD, Phase.BACKWARD}),
               Phase.FORWARD: frozenset({Phase.IDLE}),
               Phase.BACKWARD: frozenset({Phase.IDLE})}


class GathererStateError(RuntimeError):
    """An internal error: the engine moved its ``ParamGatherer`` between phases in an order it never should."""


def all_gather_units(comm: Comm, units: list, full_of: Callable, shard_of: Callable, max_inflight_numel: int) -> None:
    """All-gather ``shard_of(u)`` from every rank into ``full_of(u)`` for each unit ``u``."""
    inflight, numel = [], 0
    for u in units:
        full = full_of(u)
        if inflight and numel + full.numel() > max_inflight_numel:
            for h in inflight:
                h.wait()
            inflight, numel = [], 0
        inflight.append(comm.all_gather(full, shard_of(u), async_op=True))
        numel += full.numel()
    for h in inflight:
        h.wait()


class SecondaryShards:
    """hpZ: this rank's 1/h of every non-persistent unit (``h = comm.size``, the ranks of one node), kept from
    the primary all-gather so that backward gathers the unit over ``comm`` alone. Its buffers live as long as
    the engine (the parameters' bytes over h: ``hybrid.plan.memory`` counts them)."""

    def __init__(self, comm: Comm, layout: FlatLayout, units, dtype, device):
        self.comm = comm
        self.buffers = {u: torch.empty(layout.units[u].numel // comm.size, dtype=dtype, device=device)
                        for u in units}
        self.valid: set = set()

    def keep(self, u: int, full: torch.Tensor) -> None:
        self.buffers[u].copy_(full.view(-1).tensor_split(self.comm.size)[self.comm.rank])
        self.valid.add(u)

    def gather(self, u: int, full: torch.Tensor):
        return self.comm.all_gather(full, self.buffers[u], async_op=True)

    def tensors(self) -> list:
        return list(self.buffers.values())


class ParamGatherer:
    def __init__(self, comm, layout: FlatLayout, full: list, shard_of: Callable, persistent: set,
                 module_units: dict, prefetch_numel: int, views: list, names: dict | None = None,
                 owner: Optional[object] = None, check_comm: Optional[Comm] = None,
                 secondary: Optional[Comm] = None):
        self.comm, self.layout, self.full, self.shard_of = comm, layout, full, shard_of
        self.check_comm = check_comm or comm  # the unit check's all-reduce: every DP rank
        # Function.apply gathers what a custom autograd Function reads, while ``owner`` (the engine) lives
        self._apply_patch = FUNCTION_APPLY.hold(self if owner is None else owner)
        self.phase = Phase.IDLE
        self._views = views  # unit -> [(parameter, its view of the unit's buffer)]
        self._empty = torch.empty(0, dtype=full[0].dtype, device=full[0].device)
        self.persistent = set(persistent)
        self.module_units = module_units  # unit root -> tuple of non-persistent unit indices its subtree reads
        self.prefetch_numel = prefetch_numel
        self._names = names or {}         # id(parameter) -> its name, for messages
        self._unit_of = {id(param): u for u, pairs in enumerate(views) if u not in self.persistent
                         for param, _ in pairs}
        self._ready: set = set(self.persistent)  # every other unit starts released (storage freed)
        self._guarding = False            # inside guard(): reads of parameters not in use gather them
        for u in range(len(layout.units)):
            if u not in self.persistent:
                for param, _ in views[u]:
                    _GATHERER_OF[id(param)] = weakref.ref(self)
                    param.data = self._empty
                    param.__class__ = _released_class(_own_class(param))
        self.secondary = (SecondaryShards(secondary, layout, [u for u in range(len(layout.units))
                                                              if u not in self.persistent],
                                          self._empty.dtype, self._empty.device)
                          if secondary is not None else None)
        self._keep: set = set()           # hpZ: units whose pending gather is a primary one to keep a part of
        self._pending: dict = {}          # unit -> async handle
        self._unit_at: dict = {}          # data_ptr of a gathered unit's buffer -> the unit (saved-tensor hooks)
        self._refs = defaultdict(int)     # forward references
        self._in_backward: set = set()    # units gathered for backward, not yet done
        self._forward_only: set = set()   # gathered on demand under no_grad: released at end_forward
        self._trace: list = []            # roots in the order the current forward entered them
        self._prev_trace: list = []
        self._returned: list = []         # roots in the order their forwards returned
        self._bwd_order: list = []        # the order the backward is expected to reach the roots
        self._cursor = 0                  # backward position in _bwd_order
        self._internal = 0                # inside our own hooks: the guard stays out of the way
        self._warned: set = set()
        self.counts: Counter = Counter()
        self._order = 0                   # a hash of the units gathered since the last start_units_check()
        # its all-reduce buffer, filled by kernels: a tensor made from host numbers would sync a CUDA stream
        self._order_sums = torch.zeros(2, dtype=torch.float64, device=self._empty.device)
        for module in module_units:
            module.register_forward_pre_hook(self._pre_forward)
            module.register_forward_hook(self._post_forward)
        self._guard_state_dicts(module_units)

    def _guard_state_dicts(self, roots) -> None:
        """``state_dict()`` / ``load_state_dict()`` of a module holding released parameters raise one sentence
        (they would save empty tensors, or fail on a size mismatch): weights go through the engine.
        ``state_dict(keep_vars=True)`` (the parameter objects themselves) stays allowed. The hooks are
        module-level functions, so the model still pickles."""
        seen = set()
        for root in roots:
            for module in root.modules():
                if id(module) not in seen and _owns_released(module):
                    seen.add(id(module))
                    module.register_state_dict_pre_hook(_refuse_saving_released)
                    module.register_load_state_dict_pre_hook(_refuse_loading_released)

    # -- phase and lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Let go of the ``Function.apply`` patch now rather than when the owner is collected (idempotent)."""
        self._apply_patch()

    def _move(self, start: Phase, to: Phase) -> None:
        """Go from phase ``start`` to ``to``: ``GathererStateError`` unless the gatherer is in ``start`` and
        ``TRANSITIONS`` allows the move (the phase is then left as it was)."""
        if self.phase is not start or to not in TRANSITIONS[start]:
            allowed = " or ".join(sorted(p.value for p in TRANSITIONS[self.phase]))
            raise GathererStateError(f"internal error in the ZeRO stage-3 parameter gatherer: asked to go from "
                                     f"{start.value} to {to.value} while in {self.phase.value}, from which it only "
                                     f"goes to {allowed}")
        self.phase = to

    # -- gather / release -----------------------------------------------------------------------------
    def _nbytes(self, u: int) -> int:
        return self.layout.units[u].numel * self.full[u].element_size()

    def issue(self, u: int) -> bool:
        """Start gathering unit ``u`` unless it is already gathered or on its way; True if started."""
        if u in self._ready or u in self._pending:
            return False
        full = self.full[u]
        full.untyped_storage().resize_(self._nbytes(u))
        self._unit_at[full.untyped_storage().data_ptr()] = u
        if self.secondary is not None and self.phase is Phase.BACKWARD and u in self.secondary.valid:
            self._pending[u] = self.secondary.gather(u, full)  # inside the node
        else:
            self._pending[u] = self.comm.all_gather(full, self.shard_of(u), async_op=True)
            if self.secondary is not None:
                self._keep.add(u)
        self._order = (self._order * 1_000_003 + u + 1) % ORDER_MODULUS
        for param, view in self._views[u]:
            param.data = view
        self.counts["gathers"] += 1
        return True

    def start_units_check(self):
        """Start checking that every DP rank gathered the same units since the last check; ``finish_units_check``
        with what this returns raises ``UsageError`` on every rank when they did not.

        All-gathers of same-sized units pair up whatever unit each rank meant, so ranks that run different
        modules (an MoE expert that only one rank's tokens reach) would compute with a mix of shards, silently.
        One small async all-reduce of (h, h^2) per optimizer step: the ranks agree iff (sum h)^2 == N * sum h^2.
        """
        order, self._order = self._order, 0
        if self.check_comm.solo:
            return None
        sums = self._order_sums
        sums[0].fill_(order)
        sums[1].fill_(order * order)
        return sums, self.check_comm.all_reduce(sums, async_op=True)

    def finish_units_check(self, pending) -> None:
        if pending is None:
            return
        sums, work = pending
        work.wait()
        total, squares = (int(x) for x in sums.tolist())
        if total * total != self.check_comm.size * squares:
            raise UsageError(
                "the DP ranks gathered different ZeRO stage-3 units in this step (some ran modules the others "
                f"did not, or in another order), so their forwards mixed the shards of different modules: {SAME_MODULES}")

    def wait(self, u: int) -> None:
        handle = self._pending.pop(u, None)
        if handle is not None:
            try:
                handle.wait()
            except RuntimeError as err:  # a collective timeout (gloo); NCCL's watchdog aborts the process instead
                name = self._names.get(id(self._views[u][0][0]), f"unit {u}")
                raise RuntimeError(f"ZeRO stage 3: the all-gather of the unit holding {name!r} did not complete "
                                   f"({first_line(err, limit=200)}): a DP rank died or hung, or the ranks ran "
                                   f"different modules: {SAME_MODULES}") from err
            if u in self._keep:
                self._keep.discard(u)
                self.secondary.keep(u, self.full[u])
            self._ready.add(u)

    def release(self, u: int) -> None:
        if u in self.persistent:
            return
        self.wait(u)
        self._ready.discard(u)
        for param, _ in self._views[u]:
            param.data = self._empty
            param.__class__ = _released_class(_own_class(param))
        self._unit_at.pop(self.full[u].untyped_storage().data_ptr(), None)
        self.full[u].untyped_storage().resize_(0)

    def _in_use(self, units) -> None:
        """``units`` are gathered and in use (a running root's, or held for backward): their parameters drop
        the released class, so reading them costs nothing extra. Only units in use do: a prefetched unit
        keeps it until its root runs, so a read from elsewhere still waits for its gather and holds it."""
        for u in units:
            if u not in self.persistent:
                for param, _ in self._views[u]:
                    param.__class__ = _own_class(param)

    def gathered_units(self) -> list:
        return sorted((self._ready | set(self._pending)) - self.persistent)

    def release_all(self) -> None:
        for u in self.gathered_units():
            self.release(u)

    def _prefetch(self, modules) -> None:
        budget = self.prefetch_numel
        for module in modules:
            for u in self.module_units[module]:
                if u in self._ready or u in self._pending:
                    continue
                numel = self.layout.units[u].numel
                if numel > budget:
                    return
                budget -= numel
                if self.issue(u):
                    self.counts["prefetches"] += 1

    # -- forward --------------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self._move(Phase.IDLE, Phase.FORWARD)
        if self.secondary is not None:
            self.secondary.valid.clear()
        self._prev_trace, self._trace, self._returned = self._trace, [], []

    def end_forward(self) -> None:
        """Release what was gathered (or prefetched) in forward and is not held for backward."""
        self._move(Phase.FORWARD, Phase.IDLE)
        self._refs.clear()  # every module's forward has returned (or raised)
        self._forward_only.clear()
        for u in self.gathered_units():
            if u not in self._in_backward:
                self.release(u)
        self._bwd_order, self._cursor = list(reversed(self._returned)), 0

    @contextlib.contextmanager
    def guard(self):
        """Enter around the model's forward: reads of parameters outside their units gather them, and the
        parameters autograd saves gather their unit again when backward unpacks them."""
        if self.phase is not Phase.FORWARD or self._guarding:
            raise GathererStateError(f"internal error in the ZeRO stage-3 parameter gatherer: guard() entered "
                                     f"{'again' if self._guarding else 'in phase ' + self.phase.value}; it guards "
                                     "one forward, between begin_forward and end_forward")
        self._guarding = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._guarding = False

    def _pack(self, tensor):
        try:
            u = self._unit_at.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # sparse or storage-less tensors are never parameters
            return tensor
        return tensor if u is None else _SavedParam(u, tensor)

    def _unpack(self, saved):
        if isinstance(saved, _SavedParam):
            self._gather_for_backward(saved.unit)
            return saved.tensor
        return saved

    def _gather_for_backward(self, u: int) -> None:
        """Backward needs unit ``u``'s values (a saved parameter): gathered and held to its gradients."""
        if u in self._ready and u in self._in_backward:
            return
        name = self._names.get(id(self._views[u][0][0]), f"unit {u}")
        self._gather_on_demand(u, self._in_backward, ("backward", u),
                               f"stage 3: backward needed the unit holding {name} before any gradient reached its "
                               "root's outputs (a loss from a tensor the module kept rather than returned?), so "
                               "it is gathered on demand (an extra all-gather)")

    def _gather_on_demand(self, u: int, held: set, warn_key, message: str) -> None:
        """Gather unit ``u`` outside the hook schedule (counted, ``message`` logged once per ``warn_key``),
        wait for it, and hold it in ``held`` until that set is released."""
        self._internal += 1
        try:
            if self.issue(u):
                self.counts["on_demand"] += 1
                if warn_key not in self._warned:
                    self._warned.add(warn_key)
                    log.warning("%s", message)
            self.wait(u)
            held.add(u)
            self._in_use((u,))
        finally:
            self._internal -= 1

    def _pre_forward(self, module: nn.Module, args) -> None:
        self._internal += 1
        try:
            units = self.module_units[module]
            if self.phase is Phase.BACKWARD:  # recomputation: gathered once for this backward, held to its end
                for u in units:
                    self._in_backward.add(u)
                    self.issue(u)
            else:
                position = len(self._trace)
                self._trace.append(module)
                for u in units:
                    self._refs[u] += 1
                    self.issue(u)
                prev = self._prev_trace
                if position < len(prev) and prev[position] is module:
                    self._prefetch(prev[position + 1:])
            for u in units:
                self.wait(u)
            self._in_use(units)
        finally:
            self._internal -= 1

    def _post_forward(self, module: nn.Module, args, output) -> None:
        if self.phase is Phase.BACKWARD:
            return
        self._internal += 1
        try:
            units = self.module_units[module]
            self._returned.append(module)
            if torch.is_grad_enabled():
                tensors, opaque = _output_tensors(output)
                tensors = [t for t in tensors if t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads, m=module: self._pre_backward(m), mode="any")
                elif opaque:  # an output we cannot see into: keep the units gathered through backward
                    self._in_backward.update(units)
            for u in units:
                self._refs[u] -= 1
                if self._refs[u] == 0 and u not in self._in_backward:
                    self.release(u)
        finally:
            self._internal -= 1

    def read_outside_unit(self, tensor) -> None:
        """``tensor`` is about to be read by an op; gather its unit if no running root reads that unit."""
        u = self._unit_of.get(id(tensor))
        if u is None or self._refs[u] > 0 or u in self._in_backward or u in self._forward_only:
            return
        name = self._names.get(id(tensor), "a parameter")
        self._gather_on_demand(u, self._in_backward if torch.is_grad_enabled() else self._forward_only, name,
                               f"stage 3: {name} is read outside the forward of the unit that holds it, so it is "
                               "gathered on demand (an extra all-gather per use); make the module that reads "
                               "it its unit root (zero_optimization.stage3_unit) to avoid this")

    # -- backward -------------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self._move(Phase.IDLE, Phase.BACKWARD)

    def _pre_backward(self, module: nn.Module) -> None:
        units = self.module_units[module]
        for u in units:
            self._in_backward.add(u)
            self.issue(u)
        order = self._bwd_order
        k = next((k for k in range(self._cursor, len(order)) if order[k] is module), None)
        if k is not None:
            self._cursor = k + 1
            self._prefetch(order[k + 1:])
        for u in units:
            self.wait(u)
        self._in_use(units)

    def release_after_backward(self, u: int) -> None:
        """All gradients of unit ``u`` are in: its full parameters are no longer needed."""
        self._in_backward.discard(u)
        if self._refs[u] == 0:
            self.release(u)

    def end_backward(self) -> None:
        self._move(Phase.BACKWARD, Phase.IDLE)
        self._in_backward.clear()
        for u in self.gathered_units():
            if self._refs[u] == 0:
                self.release(u)
        self._cursor = len(self._bwd_order)


def _own_class(param) -> type:
    """The class ``param`` has when it is in use (its own), whichever it wears now."""
    return _OWN_CLASS.get(type(param), type(param))


def wears_released_class(param) -> bool:
    """Whether ``param`` is a stage-3 parameter not in use (released or only prefetched)."""
    return type(param) in _OWN_CLASS


def _owns_released(module: nn.Module) -> bool:
    return any(wears_released_class(p) for p in module._parameters.values() if p is not None)


def _refuse_saving_released(module, prefix, keep_vars) -> None:
    if not keep_vars and _owns_released(module):
        raise UsageError(f"{_module_name(prefix)}.state_dict() at ZeRO stage 3 would hold empty tensors "
                         "(the parameters are released outside the forward); use "
                         "engine.full_state_dict() (a collective on every rank) or hybrid.checkpoint")


def _refuse_loading_released(module, state_dict, prefix, *args) -> None:
    if _owns_released(module):
        raise UsageError(f"{_module_name(prefix)}.load_state_dict() at ZeRO stage 3 cannot write into "
                         "released parameters; pass the weights to hybrid.initialize(..., weights=) or "
                         "resume from a hybrid checkpoint")


def _module_name(prefix: str) -> str:
    return f"module {prefix.rstrip('.')!r}" if prefix else "the model"


class _SavedParam:
    """What the pack hook saves for a parameter: its unit and the tensor (a view of the unit's buffer)."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: int, tensor: torch.Tensor):
        self.unit, self.tensor = unit, tensor


_GATHERER_OF: dict = {}  # id(parameter wearing a released class) -> weakref to its ParamGatherer


def _gatherer_of(t):
    ref = _GATHERER_OF.get(id(t))
    g = ref() if ref is not None else None
    return g if g is not None and id(t) in g._unit_of else None  # an id reused by another tensor: none


def _gather_if_guarded(tensors) -> None:
    """Inside an engine's forward, or its backward (a forward recomputed there outside any unit root's hooks:
    Reformer's reversible layers), gather the units of the parameters not in use among ``tensors``."""
    for t in tensors:
        for p in (t if isinstance(t, (list, tuple)) else (t,)):
            if isinstance(p, torch.Tensor):
                g = _gatherer_of(p)
                if g is not None and (g._guarding or g.phase is Phase.BACKWARD) and not g._internal:
                    g.read_outside_unit(p)


def _released_torch_function(cls, func, types, args=(), kwargs=None):
    """``__torch_function__`` of a parameter not in use: inside the engine's forward, an op that reads its
    values gathers its unit first (``read_outside_unit``); then the op runs as the parameter's own class
    would run it."""
    kwargs = kwargs or {}
    if _reads_values(func):
        _gather_if_guarded((*args, *kwargs.values()))
    own = _OWN_CLASS[cls]
    if own.__torch_function__ is _DISABLED:  # nn.Parameter's own: run the op as on a plain tensor
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    types = tuple(own if t is cls else t for t in types)
    return own.__torch_function__(func, types, args, kwargs)


def _as_own_class(method: str):
    """A method that runs ``method`` of the parameter's own class, wearing it meanwhile: pickling and
    copying see the parameter as it is (an empty tensor while released), never the released class."""
    def run(self, *args):
        released = type(self)
        self.__class__ = _OWN_CLASS[released]
        try:
            return getattr(self, method)(*args)
        finally:
            self.__class__ = released
    return run


_DISABLED = torch.nn.Parameter.__torch_function__
_RELEASED_CLASSES: dict = {}  # own class -> its released class
_OWN_CLASS: dict = {}         # released class -> own class


def _gathering_apply(cls, *args, **kwargs):
    """``Function.apply`` while a stage-3 engine lives: a custom ``torch.autograd.Function`` (a fused kernel
    given ``self.fc.weight``) does not dispatch ``__torch_function__``, so inside an engine's forward autograd
    would record a parameter not in use with its released shape (0,) and backward would fail on its gradient:
    gather it first. Outside every engine's forward it only calls the original."""
    _gather_if_guarded((*args, *kwargs.values()))
    return FUNCTION_APPLY.original.__get__(None, cls)(*args, **kwargs)


class FunctionApplyPatch:
    """``torch.autograd.Function.apply`` replaced by ``_gathering_apply`` for the process while it has holders.

    ``hold(owner)`` adds a holder for ``owner``'s life: the first holder installs the patch, and the original
    ``apply`` is put back when the last holder is gone -- each owner garbage-collected, or the finalizer that
    ``hold`` returned called, whichever comes first (calling it again does nothing). Where something else
    replaced ``apply`` on top of ours meanwhile, theirs is left in place and ours stays under it (with no
    engine's forward guarding it only calls the original); later holders then hold it there rather than stack
    a second one on top, until ``apply`` is the original again."""

    def __init__(self):
        self._lock = threading.RLock()  # a finalizer can run (garbage collection) inside hold() on this thread
        self._holders = 0
        self._patch = classmethod(_gathering_apply)
        self._under_another = False  # the last holder left while another patch sat on top of ours
        self.original = None         # what ``Function.__dict__["apply"]`` was before ours

    @property
    def installed(self) -> bool:
        """Whether ``Function.apply`` is ours now."""
        return torch.autograd.Function.__dict__.get("apply") is self._patch

    @property
    def holders(self) -> int:
        return self._holders

    def hold(self, owner) -> weakref.finalize:
        release = weakref.finalize(owner, self._drop)  # first: an owner that cannot be weakly referenced fails here
        with self._lock:
            first = self._holders == 0  # else ours is in place already (on top, or under another patch)
            self._holders += 1
            if first:
                current = torch.autograd.Function.__dict__["apply"]
                if current is self._patch or current is self.original:  # no other patch on top of ours (left)
                    self._under_another = False
                if not self._under_another and current is not self._patch:
                    self.original = current
                    torch.autograd.Function.apply = self._patch
        return release

    def _drop(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                if self.installed:
                    torch.autograd.Function.apply = self.original
                else:
                    self._under_another = True


FUNCTION_APPLY = FunctionApplyPatch()


def _released_class(cls: type) -> type:
    """The class a parameter of class ``cls`` wears while not in use: ``cls`` with the ``__torch_function__``
    above. Only these parameters reach Python on every op; the ones in use cost nothing (a
    ``TorchFunctionMode`` would see every op of the forward: 2-3 us each on CPU)."""
    released = _RELEASED_CLASSES.get(cls)
    if released is None:
        released = type(f"Released{cls.__name__}", (cls,), {
            "__torch_function__": classmethod(_released_torch_function), "__module__": __name__,
            "__reduce_ex__": _as_own_class("__reduce_ex__"), "__deepcopy__": _as_own_class("__deepcopy__"),
            "__repr__": _as_own_class("__repr__")})
        _RELEASED_CLASSES[cls], _OWN_CLASS[released] = released, cls
    return released


# What a released parameter answers truthfully (flags, placement, hooks, its storage as it is now), so
# these do not gather; everything else (values, but also shape and size) does.
_METADATA = frozenset({"requires_grad", "dtype", "device", "is_leaf", "grad", "grad_fn", "_version", "layout",
                       "is_cuda", "is_meta", "is_sparse", "is_quantized", "names", "name", "untyped_storage",
                       "data_ptr", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_"})


def _reads_values(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        if name != "__get__":
            return False
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name not in _METADATA


def _output_tensors(output) -> tuple:
    """(tensors in ``output``, whether part of it could not be looked into): pytree containers, mappings
    (a Hugging Face ``ModelOutput``), dataclasses."""
    tensors, opaque, todo = [], False, [output]
    while todo:
        for leaf in tree_flatten(todo.pop())[0]:
            if isinstance(leaf, torch.Tensor):
                tensors.append(leaf)
            elif isinstance(leaf, Mapping):
                todo.append(list(leaf.values()))
            elif is_dataclass(leaf) and not isinstance(leaf, type):
                todo.append([getattr(leaf, f.name) for f in fields(leaf)])
            elif leaf is not None and not isinstance(leaf, (int, float, bool, str)):
                opaque = True
    return tensors, opaque
