"""The services' views of the ledger (broker.ledger.roles): each Protocol's methods are `Ledger`'s,
with the same signatures (mypy checks the calls against the Protocol; this keeps the Protocol
honest about the method it stands for). No I/O."""

from __future__ import annotations

import inspect

import pytest

from broker.ledger import GeneratorLedger, Ledger, RewardLedger, TrainerLedger


def methods(proto: type) -> list[str]:
    return sorted(n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_"))


@pytest.mark.parametrize("role", [GeneratorLedger, RewardLedger, TrainerLedger], ids=lambda r: r.__name__)
def test_each_role_method_is_the_ledgers(role: type) -> None:
    names = methods(role)
    assert names
    for name in names:
        assert inspect.signature(getattr(role, name)) == inspect.signature(getattr(Ledger, name)), name


def test_the_roles_are_what_the_services_call() -> None:
    assert methods(GeneratorLedger) == ["record_generated", "record_generator_load"]
    assert methods(RewardLedger) == ["record_generated", "record_scored_ids"]
    assert "record_used" in methods(TrainerLedger) and "create_job" not in methods(TrainerLedger)
