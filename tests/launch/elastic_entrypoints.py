"""Entrypoints of the elastic tests (tests/launch/test_elastic_ray.py): the built-in GPT, slowed down."""

import time

from hybrid.models.gpt import train

STEP_PAUSE_S = 0.4  # after each step: time for the test to remove or add a node between two checkpoints


def train_slowly(ctx):
    """``hybrid.models.gpt:train`` with a pause after every step."""
    return train(ctx, after_step=[lambda _ctx, _engine, _step: time.sleep(STEP_PAUSE_S)])
