"""The pool contract against CudaDeviceProvider on a real GPU, in every segment mode.

The policy itself is proven on SimulatedDevice (tests/memory); these runs
prove the provider keeps the contract with the driver underneath. Marked
``cuda``: skipped, with the reason, without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from shmshare import cuda
from shmshare.testing.pool_contract import PoolContract

from .gpu_helpers import BusyStream

pytestmark = pytest.mark.cuda


class TestCudaClassic(PoolContract):
    config = "expandable_segments:False"
    can_provoke_oom = True  # twice the device fails at once (cuMemAlloc, or the free-memory check)
    ipc = False

    def make_provider(self) -> cuda.CudaDeviceProvider:
        return cuda.CudaDeviceProvider(ipc=self.ipc)

    def busy_stream(self, provider: cuda.CudaDeviceProvider) -> tuple[int, Callable[[], None]]:
        busy = BusyStream(provider.context)
        self._busy = busy  # released by finish, closed with the provider
        return busy.handle, busy.release

    def close_provider(self, provider: cuda.CudaDeviceProvider) -> None:
        busy = getattr(self, "_busy", None)
        if busy is not None:
            busy.close()
        provider.close()


class TestCudaExpandable(TestCudaClassic):
    config = "expandable_segments:True"


class TestCudaIpcClassic(TestCudaClassic):
    ipc = True


class TestCudaIpcExpandable(TestCudaClassic):
    config = "expandable_segments:True"
    ipc = True
