"""Entrypoints of the elastic tests (tests/launch/test_elastic_ray.py): the built-in GPT, slowed down while the
test needs time between two steps."""

import os
import time

from hybrid.models.gpt import train

SLOW_FILE = "HYBRID_TEST_SLOW_FILE"  # job.env: while the file it names exists, every step is followed by a pause
STEP_PAUSE_S = 0.4  # time for the test to remove or add a node between two checkpoints


def train_slowly(ctx):
    """``hybrid.models.gpt:train`` with a pause after every step while ``$HYBRID_TEST_SLOW_FILE`` exists (the
    test deletes it once its node was removed or added: the steps after that run at full speed)."""
    path = os.environ.get(SLOW_FILE)

    def pause(_ctx, _engine, _step):
        if path and os.path.exists(path):
            time.sleep(STEP_PAUSE_S)

    return train(ctx, after_step=[pause])
