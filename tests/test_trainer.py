"""The trainer's EMA: the reference's decay warm-up, hand-checked."""

import pytest
import torch
from helpers import policy_for

from flowgrpo_cli.training.trainer import Trainer


def test_ema_decay_warms_up_like_the_reference(make_run):
    config, run = make_run("train.ema_decay=0.9", "algorithm.beta=0")
    trainer = Trainer(config, policy_for(config, run))
    name, param = next((n, p) for n, p in trainer.parameters.items() if "lora_B" in n)
    start = param.detach().clone()  # B starts at zero; so does its EMA
    for p in trainer.parameters.values():
        p.grad = torch.ones_like(p)
    trainer.step()
    # After n = 1 step the decay is min(0.9, 2 / 11): the EMA moves 9/11 of the way.
    assert trainer.ema_decay() == pytest.approx(2 / 11)
    expected = start + (9 / 11) * (param.detach() - start)
    torch.testing.assert_close(trainer.ema[name], expected)
    assert not torch.equal(trainer.ema[name], param.detach())
    for steps, decay in [(8, 9 / 18), (80, 0.9), (1000, 0.9)]:
        trainer.state.optimizer_steps = steps
        assert trainer.ema_decay() == pytest.approx(decay)
