"""The model contract by capability: every layout implements the Protocols its pipeline
supports (engine.models.contract), and the adapter pool the interface the core names."""
from __future__ import annotations

import pytest

from engine.lora.interface import AdapterResidency
from engine.models.contract import capabilities_of
from engine.models.loading import load_model
from engine.testing.tiny_pipelines import build_flux, build_sd, build_sdxl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("build,expected", [
    (build_sd, {"text encoding", "denoising", "image encoding", "adapters"}),
    (build_sdxl, {"text encoding", "denoising", "image encoding", "adapters"}),
    (build_flux, {"text encoding", "denoising", "image encoding", "adapters"}),
])
def test_each_layout_implements_its_capabilities(tmp_path, build, expected):
    model = load_model(build(tmp_path / "m"))
    assert set(capabilities_of(model)) == expected


def test_the_embedded_model():
    shapes = load_model("shapes")
    assert {"text encoding", "denoising", "image encoding"} <= set(capabilities_of(shapes))


def test_the_adapter_pool_implements_the_declared_interface(tmp_path):
    from engine.lora.pool import AdapterPool

    model = load_model(build_sd(tmp_path / "sd"))
    (tmp_path / "loras").mkdir()
    pool = AdapterPool(model, tmp_path / "loras", budget_bytes=1 << 20)
    try:
        assert isinstance(pool, AdapterResidency)
        assert model.adapter_rows is pool.rows  # bound through the model's own method
    finally:
        pool.uninstall()
    assert model.adapter_rows is None
