"""The declared interfaces: every core the engine process drives — the real
EngineCore, the tests' FakeCore, the benchmark's baseline cores — and every decode stage
satisfies its Protocol by name and by signature."""
from __future__ import annotations

import inspect

import pytest

from engine.core.engine_core import EngineCore
from engine.core.interface import CoreInterface
from engine.decode.in_process import InProcessDecodeStage
from engine.decode.inline import InlineDecodeStage
from engine.decode.stage import DecodeStage
from engine.decode.workers import MultiProcessDecodeStage
from fake_core import FakeCore


def _members(protocol) -> list[str]:
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]


def _baseline_cores() -> list[type]:
    try:
        from bench.baselines import BASELINE_CORES
    except ImportError:
        return []
    return list(BASELINE_CORES.values())


CORES = [EngineCore, FakeCore, *_baseline_cores()]
STAGES = [InProcessDecodeStage, InlineDecodeStage, MultiProcessDecodeStage]


def _check(implementation: type, protocol) -> None:
    for name in _members(protocol):
        assert hasattr(implementation, name), f"{implementation.__name__} lacks {name}"
        want = inspect.signature(getattr(protocol, name))
        got = inspect.signature(getattr(implementation, name))
        want_params = [p for p in want.parameters.values() if p.kind is not p.VAR_KEYWORD]
        got_params = list(got.parameters.values())
        for p in want_params:
            assert p.name in got.parameters, f"{implementation.__name__}.{name} lacks parameter {p.name!r}"
            if p.default is not p.empty:
                assert got.parameters[p.name].default is not p.empty, \
                    f"{implementation.__name__}.{name}: {p.name!r} must be optional"
        required = [p.name for p in got_params if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert set(required) <= {p.name for p in want_params}, \
            f"{implementation.__name__}.{name} requires more than the Protocol passes: {required}"


@pytest.mark.parametrize("core", CORES, ids=lambda c: c.__name__)
def test_cores_satisfy_the_core_protocol(core):
    _check(core, CoreInterface)


@pytest.mark.parametrize("stage", STAGES, ids=lambda c: c.__name__)
def test_decode_stages_satisfy_the_stage_protocol(stage):
    _check(stage, DecodeStage)


def test_a_real_core_instance_is_a_core_interface():
    from engine.testing.reference import tiny_model

    assert isinstance(EngineCore(tiny_model()), CoreInterface)


def test_the_check_can_fail():
    class Incomplete:
        def add_request(self, request_id):  # missing params, and everything else
            pass

    with pytest.raises(AssertionError):
        _check(Incomplete, CoreInterface)
