"""An interrupt (Ctrl+C) stays an interrupt wherever it lands, so Lightning
shuts down gracefully, as under the default strategy."""

import threading

import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy

from .modules import SeqModule, cpu_trainer, loader, seq_data


class InterruptedSGD(torch.optim.SGD):
    """Ctrl+C arriving while the third step runs."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.01)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 3:
            raise KeyboardInterrupt
        return super().step(closure)


class Interrupted(SeqModule):
    def configure_optimizers(self):
        return InterruptedSGD(self.parameters())


@pytest.mark.parametrize("strategy", ["auto", "sync"])
def test_an_interrupt_in_the_optimizer_step_shuts_down_like_lightning(strategy):
    before = {t.ident for t in threading.enumerate()}
    chosen = strategy if strategy == "auto" else RoundPipeStrategy(async_optimizer=False)
    trainer = cpu_trainer(chosen, max_steps=5)
    with pytest.raises(SystemExit):  # Lightning's answer to KeyboardInterrupt
        trainer.fit(Interrupted(extra=False), loader(seq_data(48), 8))
    assert trainer.interrupted
    assert trainer.global_step == 2
    assert {t.ident for t in threading.enumerate()} <= before
