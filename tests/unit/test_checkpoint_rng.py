"""A rank's RNG states as checkpoint bytes (``hybrid.checkpoint.rng``): the same state gives the same bytes (so
an asynchronous save's files are a synchronous one's, bit for bit), and the bytes give the state back, also
those of checkpoints written when torch's state went in as a pickled tensor."""

import pickle
import random

import torch

from hybrid.checkpoint import rng


def test_the_same_state_gives_the_same_bytes_and_they_restore_it():
    torch.manual_seed(5)
    random.seed(5)
    first = rng.capture()
    expected = (torch.rand(3), random.random())
    garbage = [torch.empty(1000) for _ in range(3)]  # other tensors allocated: no address in the bytes
    assert rng.capture() != first  # the draws moved every generator on
    rng.restore(first)
    assert rng.capture() == first and (torch.rand(3).tolist(), random.random()) == (expected[0].tolist(), expected[1])
    del garbage


def test_a_state_saved_as_a_pickled_tensor_still_restores():
    torch.manual_seed(9)
    old = pickle.dumps({"python": random.getstate(), "torch": torch.get_rng_state()})
    expected = torch.rand(4)
    rng.restore(old)
    assert torch.equal(torch.rand(4), expected)
