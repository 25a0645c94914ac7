"""Runs batch jobs: claims pending lines from the job store, generates their images on
the engine at batch priority, records each line's output or error line, finalizes
batches into output and error files, and sends their webhooks.

One runner per gateway process, a loop on the app's event loop. Every gateway on a
state dir runs one, so a job's lines spread over all of them (Ray replicas sharing a
dir), and a restarted gateway finds its predecessor's claims returned (job_store.py).

A line's fate: its body is parsed exactly as `POST /v1/images/generations` parses it
(a bad body is that route's 400, as the line's error); an engine that is busy (429) or
unreachable (503) is waited for, with backoff, until the batch's window ends; any other
error is the line's error line with the status and body the route would have answered.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time

from frontend.http.engine_calls import generate_all, request_id
from frontend.http.errors import APIError
from frontend.http.gateway_state import IMAGES_PREFIX, GatewayState
from frontend.http.job_store import new_id
from frontend.http.link import EngineLink
from frontend.http.metrics import GatewayMetrics
from frontend.http.options import BatchOptions
from frontend.http.priorities import PriorityPolicy
from frontend.http.responses import images_body
from frontend.http.schemas import check_fits, parse_generation
from frontend.http.webhooks import WebhookSender, batch_event

log = logging.getLogger("diffslot.http")

POLL_S = 0.25  # how often the store is asked for work when nothing wakes the loop sooner
BEAT_S = 2.0  # the runner's heartbeat (job_store.LEASE_S is the silence that counts as gone)
SWEEP_S = 60.0  # expired local image links are deleted this often
MAX_RETRY_WAIT_S = 10.0
ENDING_ERRORS = {"cancelled": ("batch_cancelled", "The batch was cancelled before this request ran."),
                 "expired": ("batch_expired", "The batch's completion window ended before this request ran.")}


def output_line(custom_id: str, status: int, rid: str, body: dict) -> str:
    return json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": rid, "body": body}, "error": None})


def error_line(custom_id: str, code: str, message: str) -> str:
    """A line that got no response at all (its batch ended first)."""
    return json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}})


def refused_line(custom_id: str, error: APIError) -> str:
    """A line whose request got an HTTP error: the status and body that route answers."""
    return output_line(custom_id, error.status, error.headers.get("x-request-id") or request_id(), error.body())


def output_file_id(batch_id: str, kind: str) -> str:
    """The same id on every attempt to finalize a batch, so a retried finalize rewrites it."""
    return "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]


class BatchRunner:
    def __init__(self, state: GatewayState, link: EngineLink, metrics: GatewayMetrics, policy: PriorityPolicy,
                 options: BatchOptions, webhooks: WebhookSender | None):
        self.state, self.link, self.metrics, self.policy = state, link, metrics, policy
        self.options, self.webhooks = options, webhooks
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._lines: dict[tuple[str, int], asyncio.Task] = {}  # (batch id, line) → its task
        self._deliveries: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop())

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        """Stop; hand unfinished lines back to the store for whoever runs next."""
        if self._task is None:
            return
        self._task.cancel()
        tasks = [*self._lines.values(), *self._deliveries]
        for task in tasks:
            task.cancel()
        await asyncio.gather(self._task, *tasks, return_exceptions=True)
        self.state.jobs.leave()

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        jobs = self.state.jobs
        beat_at = sweep_at = float("-inf")
        while True:
            try:
                now = time.monotonic()
                if now - beat_at >= BEAT_S:
                    jobs.beat()
                    jobs.expire_batches()
                    beat_at = now
                if now - sweep_at >= SWEEP_S:
                    sweep_at = now
                    await asyncio.to_thread(self.state.store.sweep, IMAGES_PREFIX, self.state.options.link_ttl_s)
                jobs.start_batches()
                self._stop_lines_of_ending_batches()
                for row in jobs.claim_lines(self.options.batch_concurrency - len(self._lines)):
                    key = (row["batch_id"], row["line"])
                    self._lines[key] = asyncio.ensure_future(self._run_line(row))
                while (batch := jobs.claim_finalize()) is not None:
                    await self._finalize(batch)
                if self.webhooks is not None and len(self._deliveries) < self.options.batch_concurrency:
                    if (batch := jobs.claim_webhook()) is not None:
                        task = asyncio.ensure_future(self._deliver(batch))
                        self._deliveries.add(task)
                        task.add_done_callback(self._deliveries.discard)
            except asyncio.CancelledError:
                raise
            except Exception:  # a locked or broken database, a store that fails: log, try again
                log.exception("batch runner: a pass failed; retrying")
                await asyncio.sleep(1.0)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass

    def _stop_lines_of_ending_batches(self) -> None:
        """Cancel the lines of batches that stopped being in progress (cancelled, expired)."""
        statuses = self.state.jobs.statuses(batch_id for batch_id, _ in self._lines)
        for (batch_id, line), task in list(self._lines.items()):
            if statuses.get(batch_id) != "in_progress":
                task.cancel()

    # ------------------------------------------------------------------ one line
    async def _run_line(self, row: dict) -> None:
        key = (row["batch_id"], row["line"])
        jobs = self.state.jobs
        try:
            ok, result = await self._generate(jobs.get_batch(None, row["batch_id"]), row)
            if jobs.finish_line(row["batch_id"], row["line"], ok, result):
                self.metrics.batch_lines.labels("completed" if ok else "failed").inc()
        except asyncio.CancelledError:
            jobs.release_lines([key])  # its batch is ending, or the gateway stops: someone else decides
            raise
        except Exception:
            log.exception("batch %s line %d: unexpected error; it will be retried", *key)
            jobs.release_lines([key])
            await asyncio.sleep(1.0)
        finally:
            self._lines.pop(key, None)
            self.wake()

    async def _generate(self, batch: dict, row: dict) -> tuple[bool, str]:
        custom_id = row["custom_id"]
        await self._engine_ready()
        try:
            gen = parse_generation(row["body"].encode(), self.link.models)
            gen = gen.with_priority(self.policy.of(batch["caller"]).batch_priority(gen.priority))
            welcome = self.link.welcome
            check_fits(gen, welcome.output_budget_bytes, welcome.native_size)
        except APIError as error:
            return False, refused_line(custom_id, error)
        wait_s = 0.5
        while True:
            try:
                lease = await self.link.lease(f"batch:{batch['owner']}")
                try:
                    results = await generate_all(lease.client, gen.params, self.link, self.metrics)
                finally:
                    lease.release()
                break
            except APIError as error:
                if error.status not in (429, 503):
                    return False, refused_line(custom_id, error)
                retry_after = error.headers.get("Retry-After")
                await asyncio.sleep(float(retry_after) if retry_after else wait_s)
                wait_s = min(MAX_RETRY_WAIT_S, wait_s * 2)
                await self._engine_ready()
        values = await self.state.image_values(results, gen.response_format, batch["base_url"])
        body = images_body([(v, p.seed, r.timings) for v, p, r in zip(values, gen.params, results)], gen.size,
                           image_field="url" if gen.response_format == "url" else "b64_json")
        return True, output_line(custom_id, 200, request_id(), body)

    async def _engine_ready(self) -> None:
        """Wait until the gateway has its engine (its Welcome names the model lines ask for)."""
        wait_s = 0.2
        while True:
            try:
                await self.link.client()
                return
            except APIError:
                await asyncio.sleep(wait_s)
                wait_s = min(MAX_RETRY_WAIT_S, wait_s * 2)

    # ------------------------------------------------------------------ the end of a batch
    async def _finalize(self, batch: dict) -> None:
        jobs, store = self.state.jobs, self.state.store
        ending = batch["ending"] or "completed"
        if ending in ENDING_ERRORS:
            code, message = ENDING_ERRORS[ending]
            jobs.close_unfinished(batch["id"], lambda custom_id: error_line(custom_id, code, message))
        file_ids = {}
        for kind, ok in (("output", True), ("error", False)):
            results = jobs.results(batch["id"], ok)
            if not results:
                file_ids[kind] = None
                continue
            data = ("\n".join(results) + "\n").encode()
            file_id = output_file_id(batch["id"], kind)
            await asyncio.to_thread(store.put, f"files/{file_id}", data, "application/jsonl")
            jobs.add_file(batch["owner"], "batch_output", f"{batch['id']}_{kind}.jsonl", len(data), f"files/{file_id}",
                          file_id)
            file_ids[kind] = file_id
        ended = jobs.end_batch(batch["id"], ending, file_ids["output"], file_ids["error"])
        log.info("batch %s %s: %d completed, %d failed", batch["id"], ended["status"], ended["completed"],
                 ended["failed"])

    async def _deliver(self, batch: dict) -> None:
        event_id = "evt_" + hashlib.sha256(f"{batch['id']}/{batch['status']}".encode()).hexdigest()[:24]
        _, body = batch_event(batch["id"], batch["status"], event_id)
        try:
            delivered, attempts = await self.webhooks.deliver(batch["webhook_url"], event_id, body)
        except asyncio.CancelledError:
            raise  # the gateway stops: the store hands the delivery to the next runner
        self.state.jobs.webhook_done(batch["id"], delivered, attempts)
