"""Stage-3 units: which modules are unit roots, and which parameters each unit holds (pure, no communication).

A *unit root* is a module whose whole subtree is gathered for its forward (and backward); its unit holds
every trainable parameter registered in its *domain*: the subtree minus the subtrees of nested unit roots.
The model itself is always a unit root, so its unit ("the rest") holds the parameters no other root claims.
The policy (``ZeroConfig.stage3_unit``) says which other modules are roots:

* ``"auto"``: every child (with trainable parameters) of the outermost ``nn.ModuleList`` / ``nn.ModuleDict``
  / ``nn.Sequential`` containers -- one unit per transformer block, as FSDP2 users wrap them; a child that
  is itself a container without a forward of its own (``ModuleList`` / ``ModuleDict``: only its children
  ever run) is looked through, so its children are the roots; a container inside a block stays part of
  that block.
* ``"module"``: every module that directly owns a trainable parameter (one unit per module).
* a callable ``(qualified_name, module) -> bool``: the modules it marks (the model is a root regardless); a
  marked ``ModuleList`` / ``ModuleDict`` stands for its children, as under ``"auto"``.

``model_units(model, tp, policy)`` reads off a model what the memory model (``hybrid.plan.memory``) predicts
from: the trainable parameters' element counts and each unit's parameter indices, as plain numbers.

A parameter registered on several modules (tied weights) belongs to the unit of the domain where it is
first seen (in ``named_modules`` order, as ``named_parameters`` counts it); every root whose domain also
registers it reads that unit too (``reads``). A module registered at several places (shared by two
blocks) is in the domain of each place, so every root it sits under reads its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

from torch import nn

from hybrid.plan.layout import ModelUnits
from hybrid.weights.attrs import tensor_parallel_dim

Policy = Union[str, Callable[[str, nn.Module], bool]]
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _has_no_forward(module: nn.Module) -> bool:
    """A container nothing calls (``ModuleList``, ``ModuleDict``): a hook on it would never fire."""
    return type(module).forward is nn.Module.forward


@dataclass
class UnitPlan:
    root: nn.Module
    name: str
    params: list = field(default_factory=list)  # indices of the parameters this unit holds
    reads: set = field(default_factory=set)     # indices of every parameter registered in the root's domain


def _has_trainable(module: nn.Module, index: dict) -> bool:
    return any(id(p) in index for p in module.parameters())


def unit_roots(model: nn.Module, policy: Policy, index: dict) -> list:
    """``[(name, module)]`` of the unit roots in ``named_modules`` order, the model first.

    ``index`` maps ``id(param)`` of each trainable parameter to its position."""
    if callable(policy):
        marked, roots = [(n, m) for n, m in model.named_modules() if n and policy(n, m)], [("", model)]
        taken = set()
        for name, module in marked:  # a marked container nothing calls stands for its children
            for root in _callable_roots(name, module, index):
                if id(root[1]) not in taken:
                    taken.add(id(root[1]))
                    roots.append(root)
        return roots
    if policy == "module":
        return [("", model)] + [(n, m) for n, m in model.named_modules()
                                if n and any(id(p) in index for p in m._parameters.values() if p is not None)]
    if policy != "auto":
        raise ValueError(f"unknown stage-3 unit policy {policy!r}")
    roots = [("", model)]

    def visit(prefix: str, module: nn.Module) -> None:
        if isinstance(module, CONTAINERS):
            for name, child in module.named_children():
                if not _has_trainable(child, index):
                    continue
                if isinstance(child, CONTAINERS) and _has_no_forward(child):
                    visit(prefix + name + ".", child)
                else:
                    roots.append((prefix + name, child))
            return
        for name, child in module.named_children():
            visit(prefix + name + ".", child)

    if isinstance(model, CONTAINERS):
        visit("", model)
    else:
        for name, child in model.named_children():
            visit(name + ".", child)
    return roots


def _callable_roots(name: str, module: nn.Module, index: dict) -> list:
    """The roots standing for a module a callable policy marked: itself, or for a ``ModuleList`` /
    ``ModuleDict`` (whose hooks would never fire) its children with trainable parameters, looked through
    alike."""
    if not (isinstance(module, CONTAINERS) and _has_no_forward(module)):
        return [(name, module)]
    return [root for child_name, child in module.named_children() if _has_trainable(child, index)
            for root in _callable_roots(f"{name}.{child_name}", child, index)]


def plan_units(model: nn.Module, policy: Policy, index: dict) -> list:
    """One ``UnitPlan`` per unit root (in ``named_modules`` order), every trainable parameter in exactly one."""
    roots = unit_roots(model, policy, index)
    plans = {id(m): UnitPlan(m, name) for name, m in roots}
    owner_of: dict = {}  # module path -> the UnitPlan whose domain it is in
    seen = set()
    for name, module in model.named_modules(remove_duplicate=False):  # a shared module at each of its paths
        plan = plans.get(id(module)) or owner_of[name.rpartition(".")[0]]
        owner_of[name] = plan
        for p in module._parameters.values():
            i = index.get(id(p)) if p is not None else None
            if i is None:
                continue
            plan.reads.add(i)
            if i not in seen:
                seen.add(i)
                plan.params.append(i)
    return [plans[id(m)] for _, m in roots]



def model_units(module: nn.Module, tp: int = 1, stage3_unit: Policy = "auto") -> ModelUnits:
    """``ModelUnits`` of ``module`` (a model on the meta device is enough) under the stage-3 unit policy
    ``stage3_unit``, exactly as the engine plans it. With ``tp`` > 1 on a full (single-process) model, the
    tensor-parallel parameters count ``numel / tp``: one TP rank's share."""
    params = [p for p in module.parameters() if p.requires_grad]  # parameters() yields tied ones once
    index = {id(p): i for i, p in enumerate(params)}
    numels = tuple(p.numel() // tp if tp > 1 and tensor_parallel_dim(p) is not None else p.numel() for p in params)
    plans = plan_units(module, stage3_unit, index)
    return ModelUnits(numels, tuple(tuple(plan.params) for plan in plans))
