"""Step caches through the served engine: the server's `--cache` default over the wire, a
request turning it off, a bad cache rejected naming the field, the counts in `Timings`
and the core's cache gauges in the process stats."""
from __future__ import annotations

import pytest

from engine.protocol import Completed, GenerateParams, Rejected, StepCache
from frontend import Client
from tests.proc_helpers import real_engine


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    from engine.testing.tiny_pipelines import build_flux

    return build_flux(tmp_path_factory.mktemp("served-cache") / "flux", seed=3, layers=2, single_layers=2)


@pytest.mark.timeout(300)
def test_the_server_default_a_request_off_and_a_bad_cache(tiny_flux):
    base = dict(prompt="a red circle", steps=8, seed=1, height=16, width=16)
    with real_engine("--model", str(tiny_flux), "--slots", "2", "--decode-workers", "1",
                     "--cache", "first_block:0.3") as engine, Client(engine.address) as client:
        cached = client.submit(GenerateParams(**base), progress=False)
        off = client.submit(GenerateParams(**base, cache=StepCache("off")), progress=False)
        bad = client.submit(GenerateParams(**base, cache=StepCache("taylorseer", threshold=0.2)), progress=False)
        cached, off, bad = (h.result(timeout=120) for h in (cached, off, bad))
        assert isinstance(cached, Completed) and isinstance(off, Completed), (cached, off)
        assert cached.output[:8] == b"\x89PNG\r\n\x1a\n"
        assert cached.timings.cached_steps > 0 and off.timings.cached_steps == 0
        assert isinstance(bad, Rejected) and bad.field == "cache", bad
        stats = client.stats()
        core = stats["core"] if "core" in stats else stats
        assert core["cache_hits"] == cached.timings.cached_steps and core["cache_rows_skipped"] > 0, core
