"""Priority classes, OpenAI's Files and Batch API, the output store (a local directory and
S3 through moto's server) and webhooks, through the real `openai` package against real
gateways (`python -m frontend http`) in front of fake-core engines (the images' content
does not matter here), each with a state dir of its own under pytest's tmp_path.

Every process is stopped and reaped by the context manager that started it; moto's
server runs on a thread of this process, on 127.0.0.1 and a free port.
"""
from __future__ import annotations

import base64
import collections
import contextlib
import http.server
import io
import json
import threading
import time

import httpx
import pytest

from engine.protocol import PRIORITY_CLASSES
from frontend.http.errors import APIError
from frontend.http.priorities import PRIORITY_HEADER, PriorityPolicy, parse_key_class, priority_value
from frontend.http.webhooks import sign
from tests.http_helpers import free_port, gateway, png_size
from tests.proc_helpers import fake_engine, wait_until

openai = pytest.importorskip("openai")

KEYS = ("key-fast", "key-slow")
SECRET = "whsec_" + base64.b64encode(b"a webhook secret of the tests").decode()


def batch_file(*bodies: dict, endpoint: str = "/v1/images/generations") -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": body}) + "\n"
                   for i, body in enumerate(bodies)).encode()


def upload(client, data: bytes):
    return client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")


def wait_for_batch(client, batch_id: str, statuses=("completed", "failed", "cancelled", "expired"),
                   timeout: float = 60.0):
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b, timeout,
                      interval=0.1, message=f"batch {batch_id} in {statuses}")


def jsonl(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.decode().splitlines()]


@pytest.fixture(scope="module")
def engine():
    """One fake engine for the module: 10 ms steps, so that a 40-step line takes 0.4 s."""
    with fake_engine("--step-delay", "0.01") as engine:
        yield engine


# ----------------------------------------------------------------------------- priorities


def test_priority_values_and_key_classes():
    assert priority_value("interactive") == PRIORITY_CLASSES["interactive"] and priority_value(" -3 ") == -3
    for bad in ("urgent", 1001, 2.5, True, "1e3"):
        with pytest.raises(APIError) as info:
            priority_value(bad)
        assert info.value.status == 400 and info.value.param == "priority"
    assert parse_key_class("k=interactive") == ("k", parse_key_class("k=10:10")[1])
    assert parse_key_class("k=batch")[1].ceiling == 0  # the ceiling defaults to the larger of CLASS and default
    assert parse_key_class("a=b=batch:interactive")[0] == "a=b"  # a key may hold '='
    for bad in ("k", "=batch", "k=soon", "k=interactive:batch"):
        with pytest.raises(ValueError):
            parse_key_class(bad)
    policy = PriorityPolicy(["key-fast=interactive", "*=batch"], KEYS)
    assert policy.of("key#0").priority(None) == 10 and policy.of("key#0").priority(500) == 10
    assert policy.of("key#1").priority(None) == -10 and policy.of("key#1").priority(10) == 0
    assert policy.of("key#1").batch_priority(None) == -10 and policy.of("key#0").batch_priority(10) == -10
    assert PriorityPolicy().of("addr:x").priority(10) == 0  # unconfigured: default, capped at default
    with pytest.raises(ValueError):
        PriorityPolicy(["unknown-key=interactive"], KEYS)


@pytest.mark.timeout(120)
def test_priority_classes_per_key_at_the_gateway(engine, tmp_path):
    with gateway(engine.address, "--state-dir", str(tmp_path), *(f"--api-key={k}" for k in KEYS),
                 "--key-class", "key-fast=interactive", extra_env={"DIFFSLOT_KEY_CLASSES": "key-slow=batch"}) as gw:
        def ran_at(key: str, priority=None) -> int:
            extra = {"steps": 2} if priority is None else {"steps": 2, "priority": priority}
            raw = gw.openai(key).images.with_raw_response.generate(prompt="a red circle", extra_body=extra)
            assert len(raw.parse().data) == 1
            return int(raw.headers[PRIORITY_HEADER])

        assert ran_at("key-fast") == 10 and ran_at("key-fast", "batch") == -10 and ran_at("key-fast", 7) == 7
        assert ran_at("key-slow") == -10 and ran_at("key-slow", "interactive") == 0  # capped at its ceiling
        for bad in ("urgent", 5000, 1.5, [1]):
            with pytest.raises(openai.BadRequestError) as info:
                gw.openai(KEYS[0]).images.generate(prompt="a red circle", extra_body={"steps": 2, "priority": bad})
            assert info.value.body["param"] == "priority", info.value.body
        # a streamed request says its priority too
        with gw.openai(KEYS[0]).images.with_streaming_response.generate(
                prompt="a red circle", stream=True, extra_body={"steps": 2, "priority": "default"}) as stream:
            assert stream.headers[PRIORITY_HEADER] == "0"


# ----------------------------------------------------------------------------- the Batch API


@pytest.mark.timeout(180)
def test_batch_end_to_end_with_the_openai_client(engine, tmp_path):
    with gateway(engine.address, "--state-dir", str(tmp_path), *(f"--api-key={k}" for k in KEYS),
                 "--max-batch-lines", "6", "--max-file-bytes", "20000", "--max-files-per-key", "8") as gw:
        client, other = gw.openai(KEYS[0]), gw.openai(KEYS[1])
        data = batch_file({"prompt": "a red circle", "steps": 2, "seed": 5},
                          {"prompt": "a blue square", "steps": 3, "n": 2, "size": "16x16"},
                          {"prompt": "a red circle", "steps": 2, "n": 0},  # refused as the route refuses it
                          {"prompt": "a green cross", "steps": 2, "response_format": "url"},
                          {"prompt": "a red circle", "steps": 2, "guidance": -1})  # refused by the engine
        uploaded = upload(client, data)
        assert uploaded.purpose == "batch" and uploaded.bytes == len(data) and uploaded.filename == "batch.jsonl"
        assert client.files.retrieve(uploaded.id).id == uploaded.id
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/images/generations",
                                      completion_window="24h", metadata={"job": "e2e"})
        assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 5
        done = wait_for_batch(client, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 2)
        assert done.metadata == {"job": "e2e"} and done.in_progress_at and done.finalizing_at and done.completed_at
        outputs, errors = jsonl(client, done.output_file_id), jsonl(client, done.error_file_id)
        assert sorted(line["custom_id"] for line in outputs + errors) == [f"req-{i}" for i in range(5)]
        by_id = {line["custom_id"]: line for line in outputs + errors}
        first = by_id["req-0"]["response"]
        assert first["status_code"] == 200 and first["body"]["data"][0]["seed"] == 5
        assert png_size(first["body"]["data"][0]["b64_json"]) == (32, 32)
        assert [png_size(d["b64_json"]) for d in by_id["req-1"]["response"]["body"]["data"]] == [(16, 16)] * 2
        for custom_id, param in (("req-2", "n"), ("req-4", "guidance")):
            response = by_id[custom_id]["response"]
            assert response["status_code"] == 400 and response["body"]["error"]["param"] == param, response
        # an image as a link into the local store: signed, expiring, no API key needed
        url = by_id["req-3"]["response"]["body"]["data"][0]["url"]
        image = httpx.get(url)
        assert image.status_code == 200 and image.headers["content-type"] == "image/png"
        assert httpx.get(url.replace("signature=", "signature=x")).status_code == 403
        assert httpx.get(url.split("?")[0]).status_code == 403

        # lists, and another key sees none of it
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'diffslot_http_batch_lines_total{outcome="completed"} 3.0' in metrics
        assert 'diffslot_http_batch_lines_total{outcome="failed"} 1.0' in metrics  # the engine's; one refused at once
        assert [b.id for b in client.batches.list()] == [batch.id]
        assert {f.id for f in client.files.list()} == {uploaded.id, done.output_file_id, done.error_file_id}
        assert [f.purpose for f in client.files.list(purpose="batch")] == ["batch"]
        assert list(other.batches.list()) == [] and list(other.files.list()) == []
        for call in (lambda: other.batches.retrieve(batch.id), lambda: other.files.content(done.output_file_id)):
            with pytest.raises(openai.NotFoundError):
                call()
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(batch.id)
        assert client.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)

        # bounds and malformed jobs: 400 naming the parameter, 413 for a file over the limit
        good = upload(client, batch_file({"prompt": "a red circle", "steps": 2})).id
        cases = [
            (dict(input_file_id=good, endpoint="/v1/chat/completions"), "endpoint"),
            (dict(input_file_id=good, completion_window="1h"), "completion_window"),
            (dict(input_file_id="file-missing"), "input_file_id"),
            (dict(input_file_id=upload(client, batch_file(*[{"prompt": "a red circle"}] * 7)).id), "input_file_id"),
            (dict(input_file_id=upload(client, b'{"custom_id": "a"}\nnot json\n').id), "input_file_id"),
            (dict(input_file_id=upload(client, batch_file({"prompt": "x"}, endpoint="/v1/images/edits")).id),
             "input_file_id"),
            (dict(input_file_id=good, metadata={"webhook_url": "http://127.0.0.1:1/"}), "metadata"),
        ]
        duplicated = batch_file({"prompt": "a red circle"}) * 2
        cases.append((dict(input_file_id=upload(client, duplicated).id), "input_file_id"))
        for kwargs, param in cases:
            with pytest.raises(openai.BadRequestError) as info:
                client.batches.create(**{"endpoint": "/v1/images/generations", "completion_window": "24h", **kwargs})
            assert info.value.body["param"] == param, (kwargs, info.value.body)
        with pytest.raises(openai.BadRequestError) as info:
            client.files.create(file=("x.txt", io.BytesIO(b"{}")), purpose="fine-tune")
        assert info.value.body["param"] == "purpose"
        with pytest.raises(openai.APIStatusError) as info:
            upload(client, b"x" * 30000)
        assert info.value.status_code == 413
        upload(client, batch_file({"prompt": "a red circle"}))  # the 8th file this key keeps
        with pytest.raises(openai.BadRequestError) as info:
            upload(client, batch_file({"prompt": "a red circle"}))
        assert info.value.body["code"] == "too_many_files"
        upload(other, batch_file({"prompt": "a red circle"}))  # another key has its own count


@pytest.mark.timeout(180)
def test_cancel_ends_every_line_once(engine, tmp_path):
    with gateway(engine.address, "--state-dir", str(tmp_path), "--batch-concurrency", "2") as gw:
        client = gw.openai()
        bodies = [{"prompt": "a red circle", "steps": 40, "seed": i} for i in range(8)]
        batch = client.batches.create(input_file_id=upload(client, batch_file(*bodies)).id,
                                      endpoint="/v1/images/generations", completion_window="24h")
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 30, interval=0.05,
                   message="a first line done")
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
        done = wait_for_batch(client, batch.id, timeout=30)
        assert done.status == "cancelled" and done.cancelled_at
        counts = done.request_counts
        assert counts.total == 8 and counts.completed >= 1 and counts.completed + counts.failed == 8
        outputs, errors = jsonl(client, done.output_file_id), jsonl(client, done.error_file_id)
        assert sorted(line["custom_id"] for line in outputs + errors) == sorted(f"req-{i}" for i in range(8))
        assert len(outputs) == counts.completed and errors
        assert all(line["error"]["code"] == "batch_cancelled" and line["response"] is None for line in errors)


@pytest.mark.timeout(240)
def test_a_gateway_killed_mid_batch_resumes_it_on_restart(engine, tmp_path):
    bodies = [{"prompt": "a blue cross", "steps": 50, "seed": i} for i in range(8)]  # 0.5 s each, two at once
    with gateway(engine.address, "--state-dir", str(tmp_path), "--batch-concurrency", "2") as gw:
        client = gw.openai()
        batch = client.batches.create(input_file_id=upload(client, batch_file(*bodies)).id,
                                      endpoint="/v1/images/generations", completion_window="24h")
        mid = wait_until(lambda: (b := client.batches.retrieve(batch.id)).request_counts.completed >= 2 and b, 60,
                         interval=0.05, message="two lines done")
        gw.popen.kill()  # SIGKILL: no chance to hand its claims back
        gw.popen.wait(10)
    assert mid.status == "in_progress" and mid.request_counts.completed < 8
    with gateway(engine.address, "--state-dir", str(tmp_path), "--batch-concurrency", "4") as gw:
        client = gw.openai()
        done = wait_for_batch(client, batch.id, timeout=90)
        assert done.status == "completed" and done.request_counts.completed == 8 and done.request_counts.failed == 0
        outputs = jsonl(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in outputs) == sorted(f"req-{i}" for i in range(8))
        assert done.error_file_id is None
        seeds = {line["custom_id"]: line["response"]["body"]["data"][0]["seed"] for line in outputs}
        assert seeds == {f"req-{i}": i for i in range(8)}


# ----------------------------------------------------------------------------- webhooks


class Receiver(http.server.BaseHTTPRequestHandler):
    """Answers 500 to the first `fail_first` POSTs, then 200; records each."""

    calls: list = []
    fail_first = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        type(self).calls.append(({k.lower(): v for k, v in self.headers.items()}, body, time.monotonic()))
        self.send_response(500 if len(type(self).calls) <= type(self).fail_first else 200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def receiver(fail_first: int):
    handler = type("TestReceiver", (Receiver,), {"calls": [], "fail_first": fail_first})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_signatures_are_what_openai_checks():
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:1")
    body = b'{"id": "evt_1", "type": "batch.completed"}'
    stamp = int(time.time())
    headers = {"webhook-id": "evt_1", "webhook-timestamp": str(stamp), "webhook-signature": sign(SECRET, "evt_1",
                                                                                                  stamp, body)}
    client.webhooks.verify_signature(body, headers, secret=SECRET)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.verify_signature(body + b" ", headers, secret=SECRET)


@pytest.mark.timeout(180)
def test_webhook_is_signed_and_retried_until_delivered(engine, tmp_path):
    with receiver(fail_first=2) as (url, handler):
        with gateway(engine.address, "--state-dir", str(tmp_path), "--webhook-url-prefix", url + "/hooks/",
                     "--webhook-backoff", "0.2", extra_env={"DIFFSLOT_WEBHOOK_SECRET": SECRET}) as gw:
            client = gw.openai()
            file_id = upload(client, batch_file({"prompt": "a red circle", "steps": 2})).id
            with pytest.raises(openai.BadRequestError) as info:  # only where the operator allows
                client.batches.create(input_file_id=file_id, endpoint="/v1/images/generations",
                                      completion_window="24h", metadata={"webhook_url": url + "/elsewhere"})
            assert info.value.body["param"] == "metadata"
            batch = client.batches.create(input_file_id=file_id, endpoint="/v1/images/generations",
                                          completion_window="24h", metadata={"webhook_url": url + "/hooks/done"})
            wait_until(lambda: len(handler.calls) >= 3, 30, interval=0.05, message="three deliveries")
            time.sleep(0.5)
            assert len(handler.calls) == 3  # two failures, one success, then no more
            assert client.batches.retrieve(batch.id).status == "completed"
        headers, body, _ = handler.calls[-1]
        event = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:1").webhooks.unwrap(
            body, headers, secret=SECRET)
        assert event.type == "batch.completed" and event.data.id == batch.id
        assert len({h["webhook-id"] for h, _, _ in handler.calls}) == 1  # one event, retried
        gaps = [b[2] - a[2] for a, b in zip(handler.calls, handler.calls[1:])]
        assert gaps[0] >= 0.15 and gaps[1] >= 0.35, gaps  # backoff 0.2 s, then 0.4 s
        wrong = "whsec_" + base64.b64encode(b"another secret").decode()
        with pytest.raises(openai.InvalidWebhookSignatureError):
            openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:1").webhooks.unwrap(body, headers, secret=wrong)


# ----------------------------------------------------------------------------- S3 output store


@pytest.fixture(scope="module")
def moto_s3():
    """moto's S3 server on 127.0.0.1 and a free port, with one bucket; yields its URL."""
    pytest.importorskip("boto3")
    server_module = pytest.importorskip("moto.server")
    port = free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        import boto3

        boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="outputs")
        yield url
    finally:
        server.stop()


@pytest.mark.timeout(180)
def test_outputs_in_s3_with_presigned_links(engine, tmp_path, moto_s3):
    import boto3

    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    with gateway(engine.address, "--state-dir", str(tmp_path), "--output-store", "s3://outputs/gw",
                 "--s3-endpoint-url", moto_s3, extra_env=credentials) as gw:
        client = gw.openai()
        r = client.images.generate(prompt="a red circle", response_format="url", extra_body={"steps": 2})
        url = r.data[0].url
        assert url.startswith(moto_s3 + "/outputs/gw/images/") and "Signature" in url
        image = httpx.get(url)
        assert image.status_code == 200 and png_size(base64.b64encode(image.content).decode()) == (32, 32)
        batch = client.batches.create(input_file_id=upload(client, batch_file({"prompt": "a red circle", "steps": 2})).id,
                                      endpoint="/v1/images/generations", completion_window="24h")
        done = wait_for_batch(client, batch.id)
        assert [line["custom_id"] for line in jsonl(client, done.output_file_id)] == ["req-0"]
    s3 = boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="outputs", Prefix="gw/")["Contents"]]
    assert collections.Counter(k.split("/")[1] for k in keys) == {"images": 1, "files": 2}  # input and output
    assert not (tmp_path / "outputs").exists()  # nothing went to the local store


# ----------------------------------------------------------------------------- the job store alone


def test_job_store_claims_expiry_and_a_dead_runners_lines(tmp_path):
    from frontend.http.job_store import JobStore

    def store(runner: str) -> JobStore:
        return JobStore(tmp_path / "jobs.sqlite", runner_id=runner)

    first, second = store("here:1"), store("here:2")
    lines = [(f"req-{i}", "{}") for i in range(4)]
    batch = first.create_batch(owner="o", caller="c", endpoint="/v1/images/generations", input_file_id="f",
                               completion_window="24h", window_s=3600, metadata=None, base_url="http://x/",
                               webhook_url=None, lines=lines, refused={3: "refused"}, max_active=1)
    assert batch["status"] == "validating" and batch["failed"] == 1
    assert first.create_batch(owner="o", caller="c", endpoint="e", input_file_id="f", completion_window="24h",
                              window_s=1, metadata=None, base_url="", webhook_url=None, lines=lines, refused={},
                              max_active=1) is None  # one active batch at most
    first.start_batches()
    assert [r["line"] for r in first.claim_lines(2)] == [0, 1] and [r["line"] for r in second.claim_lines(5)] == [2]
    assert second.finish_line(batch["id"], 2, True, "ok-2") and not first.finish_line(batch["id"], 2, True, "again")
    # the first runner goes silent: its claims return to the queue for the second
    first.db.execute("INSERT OR REPLACE INTO runners VALUES ('here:1', 'elsewhere', 1, 0)")
    second.beat()
    assert sorted(r["line"] for r in second.claim_lines(5)) == [0, 1]
    assert not first.finish_line(batch["id"], 0, True, "too late")  # it no longer holds the line
    assert second.finish_line(batch["id"], 0, True, "ok-0")
    # the window ends with line 1 still claimed: nothing finalizes until it is handed back
    second.db.execute("UPDATE batches SET expires_at = 0")
    second.expire_batches()
    assert second.get_batch("o", batch["id"])["status"] == "finalizing" and second.claim_finalize() is None
    second.release_lines([(batch["id"], 1)])
    claimed = second.claim_finalize()
    assert claimed["id"] == batch["id"] and claimed["ending"] == "expired"
    second.close_unfinished(batch["id"], lambda custom_id: f"expired-{custom_id}")
    assert second.results(batch["id"], True) == ["ok-0", "ok-2"]
    assert second.results(batch["id"], False) == ["expired-req-1", "refused"]
    ended = second.end_batch(batch["id"], "expired", "file-out", "file-err")
    assert ended["status"] == "expired" and (ended["completed"], ended["failed"]) == (2, 2) and ended["expired_at"]
