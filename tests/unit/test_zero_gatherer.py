"""The stage-3 ParamGatherer's phases (one explicit state, only the moves its table allows) and the scope of the
``torch.autograd.Function.apply`` patch it holds (while the engine that made it lives), in one process."""

import gc

import pytest
import torch

import hybrid
from hybrid.zero.params import FUNCTION_APPLY, TRANSITIONS, GathererStateError, Phase
from tests.dist.zero_models import ParityNet, batch, config

_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]


def _apply_now():
    return torch.autograd.Function.__dict__["apply"]


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def _stage3_engine():
    return hybrid.initialize(ParityNet(), config(3))


@pytest.fixture
def no_engine_left():
    """Every engine of the earlier tests collected: the patch is off before and after the test."""
    gc.collect()
    assert _apply_now() is _ORIGINAL_APPLY and FUNCTION_APPLY.holders == 0
    yield
    gc.collect()
    assert _apply_now() is _ORIGINAL_APPLY and FUNCTION_APPLY.holders == 0


# ------------------------------------------------------------------------------------------------ phases
def test_a_step_goes_idle_forward_idle_backward_idle(no_engine_left):
    engine = _stage3_engine()
    gatherer, seen = engine.gatherer, []
    engine.module.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(gatherer.phase))
    x, y = batch(0, 0)
    assert gatherer.phase is Phase.IDLE
    loss = engine(x, y)
    assert seen == [Phase.FORWARD] and gatherer.phase is Phase.IDLE
    loss.register_hook(lambda grad: seen.append(gatherer.phase))
    engine.backward(loss)
    engine.step()
    assert seen == [Phase.FORWARD, Phase.BACKWARD] and gatherer.phase is Phase.IDLE


def test_a_forward_that_raises_leaves_the_gatherer_idle_and_the_engine_usable(no_engine_left):
    engine = _stage3_engine()
    x, y = batch(0, 0)
    with pytest.raises(IndexError):
        engine(x + 10_000, y)  # ids outside the embedding
    assert engine.gatherer.phase is Phase.IDLE
    engine.backward(engine(x, y))
    engine.step()
    assert engine.gatherer.phase is Phase.IDLE and engine.micro_steps == 1


@pytest.fixture(scope="class")
def stage3_engine():
    engine = _stage3_engine()
    yield engine
    del engine
    gc.collect()


@pytest.fixture
def gatherer(stage3_engine):
    """The gatherer of one stage-3 engine shared by the tests of a class, idle at the start of each."""
    stage3_engine.gatherer.phase = Phase.IDLE
    yield stage3_engine.gatherer
    stage3_engine.gatherer.phase = Phase.IDLE


class TestMoves:
    @pytest.mark.parametrize("start", list(Phase))
    @pytest.mark.parametrize("to", list(Phase))
    def test_only_the_moves_of_the_table_are_made(self, gatherer, start, to):
        gatherer.phase = start
        if to in TRANSITIONS[start]:
            gatherer._move(start, to)
            assert gatherer.phase is to
        else:
            with pytest.raises(GathererStateError, match=f"internal error.*from {start.value} to {to.value} while "
                                                         f"in {start.value}"):
                gatherer._move(start, to)
            assert gatherer.phase is start

    def test_the_table_is_a_forward_or_a_backward_from_idle_and_back(self):
        assert TRANSITIONS == {Phase.IDLE: {Phase.FORWARD, Phase.BACKWARD}, Phase.FORWARD: {Phase.IDLE},
                               Phase.BACKWARD: {Phase.IDLE}}

    @pytest.mark.parametrize("calls, bad, message", [
        (["begin_forward"], "begin_forward", "from idle to forward while in forward"),
        (["begin_forward"], "begin_backward", "from idle to backward while in forward"),
        (["begin_forward"], "end_backward", "from backward to idle while in forward"),
        (["begin_backward"], "begin_forward", "from idle to forward while in backward"),
        (["begin_backward"], "end_forward", "from forward to idle while in backward"),
        ([], "end_forward", "from forward to idle while in idle"),
        ([], "end_backward", "from backward to idle while in idle"),
    ])
    def test_a_call_out_of_order_is_an_internal_error_that_changes_nothing(self, gatherer, calls, bad, message):
        for name in calls:
            getattr(gatherer, name)()
        phase = gatherer.phase
        with pytest.raises(GathererStateError, match=message + r", from which it only goes to"):
            getattr(gatherer, bad)()
        assert gatherer.phase is phase

    def test_the_guard_covers_one_forward_only(self, gatherer):
        with pytest.raises(GathererStateError, match="guard\\(\\) entered in phase idle"):
            with gatherer.guard():
                pass
        gatherer.begin_forward()
        with gatherer.guard():
            with pytest.raises(GathererStateError, match="guard\\(\\) entered again"):
                with gatherer.guard():
                    pass
        gatherer.end_forward()
        assert gatherer.phase is Phase.IDLE


# ----------------------------------------------------------------------------- the Function.apply patch
def test_the_patch_is_held_by_each_stage3_engine_and_gone_with_the_last(no_engine_left):
    first = _stage3_engine()
    assert FUNCTION_APPLY.installed and FUNCTION_APPLY.holders == 1
    second = _stage3_engine()
    assert FUNCTION_APPLY.installed and FUNCTION_APPLY.holders == 2
    del first
    gc.collect()
    assert FUNCTION_APPLY.installed and FUNCTION_APPLY.holders == 1  # still there for the other engine
    x, y = batch(0, 0)
    second.backward(second(x, y))  # which still trains
    second.step()
    del second
    gc.collect()
    assert _apply_now() is _ORIGINAL_APPLY and not FUNCTION_APPLY.installed and FUNCTION_APPLY.holders == 0


def test_stages_without_sharded_parameters_never_patch(no_engine_left):
    engines = [hybrid.initialize(ParityNet(), config(stage)) for stage in (0, 1, 2)]
    assert _apply_now() is _ORIGINAL_APPLY and all(e.gatherer is None for e in engines)


def test_closing_a_gatherer_lets_go_of_its_hold_once(no_engine_left):
    first, second = _stage3_engine(), _stage3_engine()
    first.gatherer.close()
    first.gatherer.close()  # a second close does not take the other engine's hold
    assert FUNCTION_APPLY.installed and FUNCTION_APPLY.holders == 1
    second.gatherer.close()
    assert _apply_now() is _ORIGINAL_APPLY
    del first, second
    gc.collect()
    assert FUNCTION_APPLY.holders == 0  # collecting the closed engines drops nothing more


def test_a_patch_put_on_top_of_ours_is_left_in_place_and_ours_is_not_stacked_under_it_twice(no_engine_left):
    engine = _stage3_engine()
    ours = _apply_now()

    def theirs(cls, *args, **kwargs):
        return ours.__get__(None, cls)(*args, **kwargs)

    try:
        torch.autograd.Function.apply = classmethod(theirs)
        on_top = _apply_now()
        second = _stage3_engine()
        assert _apply_now() is on_top and FUNCTION_APPLY.holders == 2  # ours is held under theirs, not on top
        assert _Twice.apply(torch.ones(2)).tolist() == [2.0, 2.0]  # theirs, then ours, then the original: once
        del engine, second
        gc.collect()
        assert _apply_now() is on_top  # theirs stays: ours, under it, only calls the original now
        again = _stage3_engine()
        assert _apply_now() is on_top and FUNCTION_APPLY.holders == 1  # held where it is, not stacked
        assert _Twice.apply(torch.ones(2)).tolist() == [2.0, 2.0]
        x, y = batch(0, 0)
        again.backward(again(x, y))
        again.step()
        del again
        gc.collect()
    finally:
        torch.autograd.Function.apply = _ORIGINAL_APPLY  # they take theirs off, and ours under it with it
    engine = _stage3_engine()  # the original is on top again: a new engine installs the patch as usual
    assert FUNCTION_APPLY.installed
    del engine
