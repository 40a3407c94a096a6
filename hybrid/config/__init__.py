"""What a user writes, read and checked: the training config, its one validation vocabulary, YAML files, units.

- ``schema``: how a section is declared once (a dataclass whose fields carry their default and check) and
  read, checked and echoed from that declaration.
- ``training``: ``TrainConfig`` and its sections (``ZeroConfig``, ``OptimizerConfig``, ...), from our dict or
  a DeepSpeed-style one; ``deepspeed``: the DeepSpeed settings without a field; ``optimizers``: the
  ``torch.optim`` lookups.
- ``validate``: the field-path-aware checkers every config (and the cluster file) uses.
- ``yamlfile``: strict YAML reading.
- ``units``: the one byte and count formatter.
"""

from hybrid.config.training import (DEEPSPEED_KNOBS, OffloadConfig, OptimizerConfig, SchedulerConfig, TrainConfig,
                                    ZeroConfig)

__all__ = ["DEEPSPEED_KNOBS", "OffloadConfig", "OptimizerConfig", "SchedulerConfig", "TrainConfig", "ZeroConfig"]
