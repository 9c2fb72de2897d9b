"""pytest plugin: SMOKE-run the GPU tests' own code over the driver model. NOT a GPU run.

    .venv/bin/python -m pytest -p tests.cuda.model_plugin tests/cuda -m cuda

installs tests/cuda/driver_model.py as the driver before collection, so
``shmshare.cuda.available()`` is True and the ``cuda`` tests run against the
model instead of being skipped. That finds mistakes in the test code and in
the Python around the driver calls on a machine without a GPU; it says
nothing about what a GPU does, and its passes must never be reported as GPU
results. Tests that start another process are skipped (the model lives in
this process only).
"""

from __future__ import annotations

import pytest

from shmshare.cuda import _driver

from .driver_model import DriverModel


def pytest_configure(config: pytest.Config) -> None:
    """Install the model before any test module asks whether CUDA is available."""
    try:
        real = _driver._import_driver()
    except ImportError:
        real = None
    _driver._state = (DriverModel(real), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip what the model cannot serve: tests whose peer is another process."""
    skip = pytest.mark.skip(reason="driver-model smoke run: the model lives in this process only")
    for item in items:
        if "another_process" in item.name:
            item.add_marker(skip)


_BANNER = "DRIVER MODEL -- NOT A GPU: these results say nothing about what a GPU does"


def pytest_report_header(config: pytest.Config) -> str:
    """Say at the top of the run that the driver is a model."""
    return _BANNER


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say it again under the counts, where a reader quotes from."""
    terminalreporter.write_line(_BANNER, yellow=True, bold=True)
