"""Fixtures shared by the curvature tests."""

from __future__ import annotations

import pytest

from kaisa.curvature import eigencorrection


@pytest.fixture(params=["host", "device"])
def scalar_reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways :meth:`EigenScales.solve` reads its scalars: on the host, as on a CPU, and
    without a host sync, an accelerator's way, run here on the CPU."""
    if request.param == "device":
        monkeypatch.setattr(eigencorrection, "_reads_on_host", lambda t: False)
    return str(request.param)
