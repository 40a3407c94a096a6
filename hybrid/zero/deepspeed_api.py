"""DeepSpeed's engine names on the ZeRO engine, for scripts written against ``deepspeed.initialize``.

``DeepSpeedNames`` is a mixin of ``ZeroEngine``: each method is DeepSpeed's name for what the engine already
does (``engine.train()``, ``get_lr()``, ``global_steps``, ``save_checkpoint(dir)``, ...); none holds state of
its own. It reads the engine's ``module``, ``lr``, ``groups``, ``last_grad_norm``, ``global_step``,
``micro_steps`` and ``config``.
"""

from __future__ import annotations

from hybrid.errors import ConfigError


class DeepSpeedNames:
    def train(self, mode: bool = True) -> "DeepSpeedNames":
        self.module.train(mode)
        return self

    def eval(self) -> "DeepSpeedNames":
        return self.train(False)

    def get_lr(self) -> list:
        """The rate of every parameter group (``lr`` times the group's ``lr_scale``)."""
        return [self.lr * g.lr_scale for g in self.groups]

    def get_global_grad_norm(self):
        return self.last_grad_norm

    @property
    def global_steps(self) -> int:
        return self.global_step

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step's ``step()`` will step the optimizer."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def save_checkpoint(self, save_dir, tag=None, client_state=None) -> str:
        """``hybrid.checkpoint.save(save_dir, engine, global_step, extra=client_state)`` (a collective); the
        checkpoint is ``save_dir/checkpoints/step-N``, so a ``tag`` other than None is refused."""
        from hybrid import checkpoint

        if tag is not None:
            raise ConfigError(f"save_checkpoint(tag={tag!r}): hybrid names checkpoints by step "
                              f"(step-{self.global_step:06d}); leave tag out")
        return str(checkpoint.save(save_dir, self, self.global_step, extra=client_state))

    def load_checkpoint(self, load_dir, tag=None) -> tuple:
        """``hybrid.checkpoint.load`` (a collective): ``(path loaded, client_state)``; ``load_dir`` is a run
        directory (its latest complete checkpoint) or one checkpoint directory."""
        from hybrid import checkpoint

        if tag is not None:
            raise ConfigError(f"load_checkpoint(tag={tag!r}): give the checkpoint directory itself as load_dir "
                              "(e.g. RUN/checkpoints/step-000100) and leave tag out")
        resumed = checkpoint.load(load_dir, self)
        return str(resumed.path), resumed.extra
