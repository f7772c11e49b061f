"""The asynchronous optimizer's own param_groups (lightning_roundpipe.groups):
queued steps use the loop's values as of when they were queued, the loop's
values are its own, and what an optimizer changes in its groups (or on
itself) while stepping persists and comes back to the loop at a drain."""

import pytest
import torch
from torch import nn

from lightning_roundpipe.groups import ThreadGroups


class _Adaptive(torch.optim.Optimizer):
    """Keeps an estimate in its group (as D-Adaptation and Prodigy do) and a
    counter on itself; records the learning rate each step used."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr, "d": 1.0})
        self.steps = 0
        self.used: list[float] = []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            self.used.append(group["lr"])
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * group["d"])
            group["d"] = group["d"] * 2
        self.steps += 1


def _optimizer() -> tuple[nn.Parameter, _Adaptive]:
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    return p, _Adaptive([p], lr=0.1)


def test_queued_steps_use_the_values_the_loop_had_when_each_was_queued():
    p, opt = _optimizer()
    groups = ThreadGroups(opt)
    first = groups.queued_step()
    opt.param_groups[0]["lr"] = 0.2  # a scheduler, after the first step was queued
    second = groups.queued_step()
    opt.param_groups[0]["lr"] = 0.3
    # the thread runs both later; the loop's value is its own meanwhile
    first()
    assert opt.param_groups[0]["lr"] == 0.3
    second()
    assert opt.used == [0.1, 0.2] and opt.param_groups[0]["lr"] == 0.3
    # updates: 0.1 * 1, then 0.2 * 2 (the estimate the first step left)
    torch.testing.assert_close(p.detach(), torch.full((3,), 1 - 0.1 - 0.4))
    # what the optimizer changed itself reaches the loop at a drain, not before
    assert opt.param_groups[0]["d"] == 1.0
    assert opt.steps == 2  # (an attribute a step rebinds is the optimizer's)
    groups.merge()
    assert opt.param_groups[0]["d"] == 4.0 and opt.param_groups[0]["lr"] == 0.3
    third = groups.queued_step()  # (the merged estimate is no change of the loop's)
    third()
    assert opt.used[-1] == 0.3 and opt.param_groups[0]["d"] == 4.0
    groups.merge()
    assert opt.param_groups[0]["d"] == 8.0


def test_a_loaded_state_dict_or_an_added_group_is_taken_whole():
    _, opt = _optimizer()
    groups = ThreadGroups(opt)
    groups.queued_step()()
    state = opt.state_dict()
    state["param_groups"][0]["d"] = 100.0
    state["param_groups"][0]["lr"] = 0.5
    opt.load_state_dict(state)  # (new group dicts)
    groups.queued_step()()
    assert opt.used == [0.1, 0.5]
    groups.merge()
    assert opt.param_groups[0]["d"] == 200.0
    q = nn.Parameter(torch.zeros(2))
    q.grad = torch.ones(2)
    opt.add_param_group({"params": [q], "lr": 1.0})
    groups.queued_step()()
    assert opt.used[-2:] == [0.5, 1.0]
    torch.testing.assert_close(q.detach(), torch.full((2,), -1.0))


def test_a_scheduler_stepping_on_the_loop_sees_the_step_taken():
    """An LR scheduler wraps optimizer.step on the instance to notice it ran;
    the thread steps past that wrapper, so queuing counts as the step (no
    "lr_scheduler.step() before optimizer.step()" warning)."""
    import warnings

    _, opt = _optimizer()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    groups = ThreadGroups(opt)
    run = groups.queued_step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()
    run()
    assert opt.used == [0.1] and opt.param_groups[0]["lr"] == 0.05


def test_a_skipped_step_leaves_its_changes_to_the_next():
    """A step skipped for a non-finite gradient never runs its function: the
    loop's changes queued with it reach the thread with the next step."""
    _, opt = _optimizer()
    groups = ThreadGroups(opt)
    groups.queued_step()()
    opt.param_groups[0]["lr"] = 0.7  # set once, queued with a step that is skipped
    groups.queued_step()  # (skipped: never called)
    groups.queued_step()()
    assert opt.used == [0.1, 0.7]


def test_a_tensor_rate_changed_in_place_is_the_loops_alone():
    """Schedulers change a tensor learning rate in place (fill_): the queued
    step still uses the rate it was queued with."""
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=torch.tensor(1.0))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    groups = ThreadGroups(opt)
    run = groups.queued_step()
    sched.step()  # in place: 0.5
    assert float(opt.param_groups[0]["lr"]) == 0.5
    run()
    torch.testing.assert_close(p.detach(), torch.zeros(2))  # 1 - 1.0 * 1
    groups.queued_step()()
    torch.testing.assert_close(p.detach(), torch.full((2,), -0.5))


def test_the_optimizers_own_values_survive_an_added_group_and_yield_to_the_loops():
    _, opt = _optimizer()
    groups = ThreadGroups(opt)
    for _ in range(3):
        groups.queued_step()()
    q = nn.Parameter(torch.zeros(2))
    q.grad = torch.ones(2)
    opt.add_param_group({"params": [q], "lr": 1.0})  # (BaseFinetuning's unfreezing)
    groups.merge()
    assert opt.param_groups[0]["d"] == 8.0
    groups.queued_step()()
    groups.merge()
    assert opt.param_groups[0]["d"] == 16.0 and opt.param_groups[1]["d"] == 2.0
    # a value the loop set after its last queued step wins over the optimizer's
    groups.queued_step()()
    opt.param_groups[0]["d"] = 0.25
    groups.merge()
    assert opt.param_groups[0]["d"] == 0.25
    groups.queued_step()()
    assert opt.used[-2:] == [0.1, 1.0]
    groups.merge()
    assert opt.param_groups[0]["d"] == 0.5  # (stepped from the loop's 0.25)


class _Lookahead(torch.optim.Optimizer):
    """A wrapper sharing its base optimizer's groups, as Lookahead does."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = base.state
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    def step(self, closure=None):
        return self.base.step(closure)


def test_a_wrapper_sharing_its_bases_groups_has_the_base_step_with_the_threads():
    _, base = _optimizer()
    opt = _Lookahead(base)
    groups = ThreadGroups(opt)
    run = groups.queued_step()
    opt.param_groups[0]["lr"] = 0.9  # the loop, after queuing
    run()
    assert base.used == [0.1] and base.steps == 1
    assert opt.param_groups[0]["lr"] == 0.9


def test_an_optimizer_with_param_groups_as_a_property_is_refused_naming_the_option():
    class Wrapped(torch.optim.Optimizer):
        def __init__(self, base):
            self.base = base

        @property
        def param_groups(self):
            return self.base.param_groups

    with pytest.raises(ValueError, match="use strategy='roundpipe_sync'"):
        ThreadGroups(Wrapped(_optimizer()[1]))
