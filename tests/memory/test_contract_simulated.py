"""The pool contract, run against the simulated device in both segment modes."""

from __future__ import annotations

from collections.abc import Callable

from shmshare.memory import SimulatedDevice, SimulatedStream
from shmshare.testing.pool_contract import PoolContract, run_pool_contract


class TestSimulatedClassic(PoolContract):
    config = "expandable_segments:False"
    can_provoke_oom = True

    def make_provider(self) -> SimulatedDevice:
        return SimulatedDevice(1 << 30)

    def busy_stream(self, provider: SimulatedDevice) -> tuple[SimulatedStream, Callable[[], int]]:
        stream = provider.new_stream()
        stream.enqueue()
        return stream, stream.run


class TestSimulatedExpandable(TestSimulatedClassic):
    config = "expandable_segments:True"


def test_the_contract_runs_outside_pytest_too() -> None:
    for config in ("expandable_segments:False", "expandable_segments:True"):
        run_pool_contract(lambda: SimulatedDevice(1 << 30), config, steps=50)
