"""The gateway's persistent side, opened on first use: the state dir, its job store and
its output store, and who owns what.

A gateway that never serves a file, a batch or an image link leaves nothing on disk; one
whose state dir already holds jobs opens it at start, so that unfinished batches resume.
"""
from __future__ import annotations

import asyncio
import base64
import pathlib
import secrets
from typing import Callable

from engine.protocol import Completed
from frontend.http.job_store import JobStore
from frontend.http.options import StoreOptions
from frontend.http.output_store import LinkSigner, open_store
from frontend.http.state_dir import DATABASE_FILE, OPEN_OWNER, default_state_dir, owner_tag, secret_key

IMAGES_PREFIX = "images"


class GatewayState:
    def __init__(self, options: StoreOptions, api_keys: tuple[str, ...] = (), on_open: Callable[[], None] = None):
        self.options = options
        self.directory = pathlib.Path(options.state_dir) if options.state_dir else default_state_dir()
        self.api_keys = api_keys
        self.on_open = on_open
        self._jobs: JobStore | None = None
        self._store = None
        self._owners: dict[str, str] = {}

    @property
    def exists(self) -> bool:
        return (self.directory / DATABASE_FILE).exists()

    @property
    def is_open(self) -> bool:
        return self._jobs is not None

    async def open_when_it_exists(self, poll_s: float = 1.0) -> None:
        """Open the state dir as soon as it holds a job database."""
        while not self.is_open:
            if self.exists:
                self.open()
                return
            await asyncio.sleep(poll_s)

    def open(self) -> None:
        if self._jobs is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = secret_key(self.directory)
        self._owners = {f"key#{i}": owner_tag(key, api_key) for i, api_key in enumerate(self.api_keys)}
        self._store = open_store(self.options.output_store or str(self.directory / "outputs"), LinkSigner(key),
                                 endpoint_url=self.options.s3_endpoint_url, region=self.options.s3_region)
        self._jobs = JobStore(self.directory / DATABASE_FILE)
        if self.on_open is not None:
            self.on_open()

    @property
    def jobs(self) -> JobStore:
        self.open()
        return self._jobs

    @property
    def store(self):
        self.open()
        return self._store

    def owner(self, caller: str) -> str:
        """Whose files and batches a caller sees: its API key's; everyone's without keys."""
        self.open()
        return self._owners.get(caller, OPEN_OWNER) if self.api_keys else OPEN_OWNER

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.close()

    async def image_values(self, results: list[Completed], response_format: str, base_url: str) -> list[str]:
        """Each image as the response carries it: base64, or a link to it in the store."""
        if response_format != "url":
            return [base64.b64encode(r.output).decode("ascii") for r in results]
        store, links = self.store, []
        for result in results:
            name = f"{IMAGES_PREFIX}/{secrets.token_hex(16)}.png"
            await asyncio.to_thread(store.put, name, result.output, "image/png")
            links.append(await asyncio.to_thread(store.link, name, self.options.link_ttl_s,
                                                 self.options.public_url or base_url))
        return links
