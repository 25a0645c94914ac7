"""`AsyncClient`: the asyncio face of `frontend.client.Client` (the same IO thread underneath)."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable

from engine.protocol import GenerateParams, HealthReply, PartialImage, Progress
from frontend.client import Client
from frontend.request_handle import Result


class AsyncClient:
    """asyncio face of Client (same IO thread underneath):

        async with AsyncClient(address) as c:
            r = await c.generate(params)   # cancelling the awaiting task cancels the request
    """

    def __init__(self, address: str | None = None, *, executor: concurrent.futures.Executor | None = None,
                 **client_kwargs):
        self._client = Client(address, **client_kwargs)
        # the threads its blocking calls wait in (None: the loop's default): a server passes its
        # own, so that waits on the engine never queue behind the app's other blocking work
        self._executor = executor

    def _in_thread(self, fn, *args):
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def __aenter__(self) -> "AsyncClient":
        await self._in_thread(self._client.connect)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._in_thread(self._client.close)

    @property
    def client(self) -> Client:
        return self._client

    async def generate(self, params: GenerateParams, *,
                       on_progress: Callable[[Progress], None] | None = None,
                       partial_images: int = 0,
                       on_partial_image: Callable[[PartialImage], None] | None = None) -> Result:
        """Submit and await the result. Raises EngineDeadError if the engine dies.
        `on_partial_image` is called on the event loop for each of `partial_images` previews."""
        loop = asyncio.get_running_loop()
        callback = None if on_partial_image is None else \
            (lambda p: loop.call_soon_threadsafe(on_partial_image, p))
        handle = self._client.submit(params, progress=on_progress is not None, partial_images=partial_images,
                                     on_partial_image=callback)
        done = loop.create_future()
        handle.add_done_callback(lambda h: loop.call_soon_threadsafe(_resolve, done))
        try:
            if on_progress is not None:
                progress = handle.progress()
                while True:  # one blocking read per step, off the event loop
                    item = await loop.run_in_executor(self._executor, next, progress, None)
                    if item is None:
                        break
                    on_progress(item)
            await done
        except asyncio.CancelledError:
            handle.cancel()
            raise
        return handle.result(0)

    async def stats(self) -> dict[str, Any]:
        return await self._in_thread(self._client.stats)

    async def adapters(self) -> list[str]:
        return await self._in_thread(self._client.adapters)

    async def health(self, timeout: float = 5.0) -> HealthReply:
        return await self._in_thread(self._client.health, timeout)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
