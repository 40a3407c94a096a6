"""Which ``torch.optim`` class an ``optimizer.type`` names, the keyword arguments a config may give it, and its
default weight decay. Pure lookups (torch is imported on first use: the config is read on the driver too).

Any elementwise ``torch.optim`` class is accepted by name, in any case; ``Adam``/``AdamW`` are one family whose
member follows ``decoupled`` (DeepSpeed's ``adam_w_mode``). Classes whose state is not one value per parameter
element (``NOT_ELEMENTWISE``) are refused by name: they cannot step ZeRO's flat shards.
"""

from __future__ import annotations

import inspect

from hybrid.config import validate as v
from hybrid.errors import ConfigError

# torch.optim classes whose state is not one tensor per element (or that need a closure): refused by name
NOT_ELEMENTWISE = ("lbfgs", "sparseadam", "adafactor", "muon")
_TORCH_MANAGED = {"params", "foreach", "fused", "capturable", "differentiable"}


def torch_optimizer_class(kind: str, decoupled: bool = True, where: str = "optimizer.type"):
    """The ``torch.optim`` class named ``kind`` (any case); ``Adam``/``AdamW`` follow ``decoupled``."""
    import torch

    if not isinstance(kind, str) or not kind:
        raise v.invalid(where, "the name of a torch.optim optimizer (AdamW, Adam, SGD, ...)", kind)
    if kind.lower() in ("adam", "adamw"):
        return torch.optim.AdamW if decoupled else torch.optim.Adam
    if kind.lower() in NOT_ELEMENTWISE:
        raise ConfigError(f"{where} is {kind}, whose state is not one value per parameter element, so it cannot "
                          f"be stepped on ZeRO's flat shards; use an elementwise optimizer such as AdamW or SGD.")
    names = {n.lower(): n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
             and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}
    if kind.lower() not in names:
        known = sorted(n for n in names.values() if n.lower() not in NOT_ELEMENTWISE)
        raise v.invalid(where, "one of " + ", ".join(known), kind)
    return getattr(torch.optim, names[kind.lower()])


def optimizer_kwargs_allowed(cls) -> tuple:
    """The keyword arguments of ``cls`` a config may set (torch's own implementation switches excluded)."""
    names = list(inspect.signature(cls.__init__).parameters)[1:]
    return tuple(n for n in names if n not in _TORCH_MANAGED)


def default_weight_decay(kind: str, decoupled: bool = True) -> float:
    """The weight decay of ``torch.optim.<kind>`` when none is given: its constructor's default (AdamW 0.01;
    Adam 0 even where it runs as AdamW, as DeepSpeed's Adam; SGD, RMSprop, Adagrad 0)."""
    import torch

    cls = torch.optim.Adam if kind.lower() == "adam" else torch_optimizer_class(kind, decoupled)
    param = inspect.signature(cls.__init__).parameters.get("weight_decay")
    default = param.default if param is not None else inspect.Parameter.empty
    return 0.0 if default is inspect.Parameter.empty else float(default)
