"""A stall is not a death: an engine process stopped (SIGSTOP) for longer than the peer
timeout and then continued loses nothing — its clients (sync, async, and the HTTP
gateway's) keep their requests, and the engine does not write its clients off for the
silence its own stop caused; an engine process that is gone is still declared dead at
once. On the fake core, so it is fast. Before, every client wrote off every request in
flight after `peer_timeout_s` of silence, and the engine wrote off every client."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from engine.protocol import Completed, GenerateParams
from frontend.async_client import AsyncClient
from frontend.client import Client, EngineDeadError, local_process_state

from http_helpers import gateway
from proc_helpers import fake_engine

pytestmark = pytest.mark.timeout(120)

STOP_S = 3.0  # past the 1 s peer timeout below, far short of the client's stall timeout


def _stopped(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
        assert local_process_state("ipc:///x", pid) == "stopped"
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_stopped_engine_is_a_stall_and_every_request_completes():
    with fake_engine("--peer-timeout", "1", "--heartbeat-interval", "0.2", "--step-delay", "0.05") as engine, \
            Client(engine.address) as sync_client, gateway(engine.address) as gw:
        async def through_async_client() -> list:
            async with AsyncClient(engine.address) as client:
                await asyncio.sleep(0.3)
                return await asyncio.gather(*(client.generate(GenerateParams("a red circle", steps=40, seed=k,
                                                                             output="latent")) for k in range(3)))

        handles = [sync_client.submit(GenerateParams("a blue square", steps=40, seed=k, output="latent"))
                   for k in range(4)]
        with httpx.Client(timeout=60) as http:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                in_http = [pool.submit(http.post, gw.url + "/v1/images/generations",
                                       json={"prompt": "a red circle", "steps": 40, "size": "32x32", "seed": k})
                           for k in range(2)]
                in_async = pool.submit(asyncio.run, through_async_client())
                time.sleep(0.8)  # every request is in the engine
                _stopped(engine.pid, STOP_S)
                results = [h.result(60) for h in handles] + in_async.result(60)
                responses = [f.result(60) for f in in_http]
        assert all(isinstance(r, Completed) for r in results), results
        assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
        assert sync_client.alive and sync_client.stalls == 1
        stats = sync_client.stats()
        assert stats["io_stalled_s"] >= STOP_S - 1.0


def test_a_killed_engine_is_still_dead_at_once():
    with fake_engine("--peer-timeout", "1", "--step-delay", "0.05") as engine, Client(engine.address) as client:
        handle = client.submit(GenerateParams("a blue square", steps=400, output="latent"))
        time.sleep(0.3)
        start = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            handle.result(30)
        assert time.monotonic() - start < 5


def test_local_process_state_tells_running_stopped_and_gone():
    assert local_process_state("ipc:///x", os.getpid()) == "running"
    assert local_process_state("tcp://127.0.0.1:5555", os.getpid()) == "running"
    assert local_process_state("tcp://10.1.2.3:5555", os.getpid()) is None  # another machine's pid
    assert local_process_state("ipc:///x", 0) is None
    assert local_process_state("ipc:///x", 2 ** 22 + 12345) == "gone"
