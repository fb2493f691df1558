"""Each algorithm is one object behind the protocol of training/algorithms/base.py: the stages
ask it, never its name, so an algorithm added to the registry runs through every stage."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
import torch
from helpers import do_rollout, do_score, do_update

import flowgrpo_cli
import flowgrpo_cli.stages
from flowgrpo_cli.algorithm.loss import LossTerms
from flowgrpo_cli.store.config import AlgorithmSection
from flowgrpo_cli.training import algorithms
from flowgrpo_cli.training.algorithms import ALGORITHMS, algorithm_for
from flowgrpo_cli.training.algorithms.forward_process import ForwardProcess, NoiseLevel

REGISTRY = Path(algorithms.__file__).parent


def test_the_registry_holds_every_name_the_config_accepts():
    accepted = typing.get_args(typing.get_type_hints(AlgorithmSection)["name"])
    assert set(accepted) == set(ALGORITHMS)
    assert all(cls.name == name for name, cls in ALGORITHMS.items())


def _names_compared(tree: ast.AST) -> list[int]:
    """Lines comparing `<...>.algorithm.name` or a string that names an algorithm."""
    names = set(ALGORITHMS)

    def suspect(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and node.value in names:
            return True
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(suspect(element) for element in node.elts)
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "name"
            and isinstance(node.value, ast.Attribute | ast.Name)
            and getattr(node.value, "attr", getattr(node.value, "id", None)) == "algorithm"
        )

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(map(suspect, [node.left, *node.comparators]))
    ]


def test_the_name_checker_finds_a_comparison():
    planted = 'if config.algorithm.name == "nft":\n    pass\nok = kind in ("awm", "x")\n'
    assert _names_compared(ast.parse(planted)) == [1, 3]
    assert _names_compared(ast.parse("ok = algorithm.needs_trajectory\n")) == []


def test_no_module_outside_the_registry_compares_the_algorithm_name():
    roots = [Path(flowgrpo_cli.__file__).parent, Path(flowgrpo_cli.stages.__file__).parent]
    found = {
        f"{path}:{line}"
        for root in roots
        for path in root.rglob("*.py")
        if REGISTRY not in path.parents
        for line in _names_compared(ast.parse(path.read_text()))
    }
    assert found == set()


@dataclasses.dataclass(frozen=True)
class PlantedOutput(LossTerms):
    planted_error: torch.Tensor


class Planted(ForwardProcess):
    """A new algorithm in a dozen lines: advantage-signed flow matching of the clean latent."""

    name = "planted"
    folds: typing.ClassVar[dict[str, str]] = {"loss": "mean", "kl": "mean", "planted_error": "mean"}
    calls: typing.ClassVar[list[bool]] = []

    def default_timestep_count(self, num_steps: int) -> int:
        return 1

    def timestep_indices(self, num_steps, count, generator):
        return torch.randint(num_steps, (count,), generator=generator)

    def uses_anchor_velocity(self) -> bool:
        return False

    def level_loss(self, level: NoiseLevel):
        target = level.noise - level.x0
        error = ((level.v - target) ** 2).mean(dim=tuple(range(1, target.ndim)))
        Planted.calls.append(True)
        loss = (level.advantages.sign() * error).mean()
        return PlantedOutput(loss, torch.zeros(()), len(error), error.detach().mean())


def test_an_algorithm_added_to_the_registry_runs_through_every_stage(make_run, monkeypatch):
    """Registered under a new name, the planted algorithm samples, trains and reports through
    the unchanged stages: its loss moves the weights and its metrics reach update/..."""
    monkeypatch.setitem(ALGORITHMS, "planted", Planted)
    config, run = make_run("sampler.guidance_scale=1.0", "algorithm.beta=0",
                           "algorithm.drop_zero_advantage=false")  # fmt: skip
    config.algorithm.name = "planted"  # past the config's own check, as a new entry would be
    assert isinstance(algorithm_for(config), Planted)
    do_rollout(config, run)
    do_score(config, run)
    Planted.calls.clear()
    (result, trainer) = do_update(config, run)
    assert Planted.calls  # the stage called its loss
    assert "update/planted_error" in result.metrics
    assert "update/kl_velocity" in result.metrics  # the forward-process family's naming
    assert trainer.anchor is None  # no anchor declared, none kept


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_declares_what_the_stages_ask(make_run, name):
    config, _ = make_run(f"algorithm.name={name}", "sampler.window_size=1")
    algorithm = algorithm_for(config)
    assert "kl" in algorithm.folds  # the update renames it by the algorithm's convention
    assert algorithm.trained_terms()[0] >= 1
    assert isinstance(algorithm.no_grad_forwards(), list)
    algorithm.check()
    schedule = algorithm.step_schedule(0)
    assert len(schedule.stochastic) == config.sampler.num_steps
