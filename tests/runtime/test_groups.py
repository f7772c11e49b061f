"""The asynchronous optimizer's own param_groups (lightning_roundpipe.groups):
queued steps use the loop's values as of when they were queued, the loop's
values are its own, and what an optimizer changes in its groups (or on
itself) while stepping persists and comes back to the loop at a drain."""

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
