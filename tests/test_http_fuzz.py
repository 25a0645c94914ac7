"""Property-based fuzzing of the HTTP gateway from its own OpenAPI document (R22).

Hypothesis strategies are built from `app.openapi()`: for every operation, request
bodies that follow the documented schema (types, ranges, enums, patterns, examples),
and bodies that break it (a field of the wrong type, an unknown field, a missing
one, any JSON at all, bytes that are not JSON, a body over the size limit), with a
valid, a wrong or no API key. Each goes through the real app (httpx's ASGI
transport, in this process) to a fake-core engine. Every answer must be a status
that operation documents, non-200 answers must have OpenAI's error shape, and none
may be a 500 (this engine fails nothing); afterwards the gateway must still serve a
plain request and the engine must hold no request of ours.

Bounded for CI: a fixed number of examples, a small output budget on the engine (so
large requests are refused early rather than generated) and a small body limit.
"""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from frontend import Client  # noqa: E402
from frontend.http.app import create_app  # noqa: E402
from frontend.http.link import EngineLink  # noqa: E402
from frontend.http.options import GatewayLimits, StoreOptions  # noqa: E402
from tests.proc_helpers import fake_engine, wait_until  # noqa: E402

KEY = "fuzz-key"
MAX_BODY = 4096
EXAMPLES = 400

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10)


# ----------------------------------------------------------------------------- schema → strategy


def from_schema(schema: dict, components: dict) -> st.SearchStrategy:
    """Values valid under `schema` (the subset of JSON Schema the gateway's document uses)."""
    if schema is True:  # JSON Schema's "anything"
        return JSON_VALUES
    if schema is False:
        return st.nothing()
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[-1]], components)
    constraints = {k: v for k, v in schema.items() if k not in ("anyOf", "description", "default", "title")}
    if "anyOf" in schema:
        return st.one_of([from_schema({**constraints, **option}, components) for option in schema["anyOf"]])
    valid = _typed(schema, components)
    if schema.get("examples"):
        valid = st.sampled_from(schema["examples"]) | valid
    return valid


def _typed(schema: dict, components: dict) -> st.SearchStrategy:
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":  # small values, the bounds and the wire's limits, and anything in range
        low, high = schema.get("minimum"), schema.get("maximum")
        edges = [v for v in (low, high, -1, 0, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1)
                 if v is not None and (low is None or v >= low) and (high is None or v <= high)]
        small = st.integers(max(low, -3) if low is not None else -3, min(high, 40) if high is not None else 40)
        return st.one_of(small, small, st.sampled_from(edges), st.integers(low, high))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(re.compile(schema["pattern"]))
        return st.text(max_size=30)
    if kind == "array" and "prefixItems" in schema:  # a tuple (`original_size`: height, width)
        return st.tuples(*(from_schema(item, components) for item in schema["prefixItems"])).map(list)
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components), max_size=3)
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))
        extra = schema.get("additionalProperties")
        if not properties and isinstance(extra, dict):  # a map (`loras`: name → scale)
            return st.dictionaries(st.text(max_size=8), from_schema(extra, components), max_size=3)
        return st.fixed_dictionaries(
            {name: from_schema(properties[name], components) for name in properties if name in required},
            optional={name: from_schema(properties[name], components) for name in properties
                      if name not in required})
    return JSON_VALUES


def body_strategy(schema: dict, components: dict) -> st.SearchStrategy:
    """Request bodies: mostly valid by the schema, the rest broken in one of several ways."""
    valid = from_schema(schema, components)
    properties = sorted(components[schema["$ref"].rsplit("/", 1)[-1]]["properties"])
    variants = {
        "valid": valid,
        "mistyped": st.tuples(valid, st.sampled_from(properties), JSON_VALUES).map(lambda t: {**t[0], t[1]: t[2]}),
        "unknown field": st.tuples(valid, st.text(min_size=1, max_size=12), JSON_VALUES).map(
            lambda t: {**t[0], t[1]: t[2]}),
        "missing prompt": valid.map(lambda body: {k: v for k, v in body.items() if k != "prompt"}),
        "oversized": valid.map(lambda body: {**body, "negative_prompt": "z" * MAX_BODY}),
        "any JSON": JSON_VALUES,
    }
    encoded = {name: strategy.map(lambda body: json.dumps(body).encode()) for name, strategy in variants.items()}
    encoded["not JSON"] = st.binary(max_size=64)
    # explicit weights: hypothesis's one_of does not draw its branches evenly
    weights = ["valid"] * 8 + sorted(set(encoded) - {"valid"})
    return st.sampled_from(weights).flatmap(encoded.__getitem__)


def operations(document: dict) -> list[tuple[str, str, dict]]:
    return [(method.upper(), path, operation) for path, methods in sorted(document["paths"].items())
            for method, operation in sorted(methods.items())]


# ----------------------------------------------------------------------------- the app under test


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The app in this process, on its own event loop, in front of a fake engine whose
    budget (1.5 MB per client) keeps every generated request small; its state dir (batch
    jobs, image links) is the test's own."""
    with fake_engine("--output-budget", "1500000") as engine:
        loop = asyncio.new_event_loop()
        link = EngineLink(engine.address, connect_timeout_s=10)
        app = create_app(link, GatewayLimits(api_keys=[KEY], max_body_bytes=MAX_BODY, rate_limit=200, rate_burst=50),
                         own_link=False, store=StoreOptions(state_dir=str(tmp_path_factory.mktemp("state"))))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gateway", timeout=60)
        try:
            assert loop.run_until_complete(link.wait_connected(30)), "the gateway did not connect"
            yield engine, loop, app, link, http
        finally:
            loop.run_until_complete(http.aclose())
            loop.run_until_complete(link.close())
            loop.close()


def documented_statuses(operation: dict) -> set[int]:
    return {int(status) for status in operation["responses"]}


@pytest.mark.timeout(240)
def test_every_answer_is_documented_and_the_gateway_survives(gateway):
    engine, loop, app, link, http = gateway
    document = app.openapi()
    components = document["components"]["schemas"]
    ops = operations(document)
    contents = {path: op["requestBody"]["content"] for _, path, op in ops if "requestBody" in op}
    bodies = {path: body_strategy(content["application/json"]["schema"], components)
              for path, content in contents.items() if "application/json" in content}
    forms = {path for path, content in contents.items() if "multipart/form-data" in content}
    seen: dict[tuple[str, int], int] = {}
    # the images routes, where the engine is, drawn as often as all the others together
    images = [op for op in ops if op[1].startswith("/v1/images")]
    weighted = ops + images * max(1, (len(ops) - len(images)) // len(images))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(data=st.data())
    def exchange(data):
        method, path, operation = data.draw(st.sampled_from(weighted), label="operation")
        auth = data.draw(st.sampled_from([f"Bearer {KEY}"] * 6 + ["Bearer wrong", "", "Basic x"]),
                         label="authorization")
        headers = {"authorization": auth} if auth else {}
        content = None
        if path in bodies:
            content = data.draw(bodies[path], label="body")
            headers["content-type"] = "application/json"
        elif path in forms:  # uploads: arbitrary bytes under a form's content type
            content = data.draw(st.binary(max_size=4096), label="form body")
            boundary = data.draw(st.sampled_from(["b", "----x", ""]), label="boundary")
            headers["content-type"] = f"multipart/form-data; boundary={boundary}" if boundary else "multipart/form-data"
        response = loop.run_until_complete(http.request(method, path, content=content, headers=headers))
        status = response.status_code
        seen[(path, status)] = seen.get((path, status), 0) + 1
        assert status in documented_statuses(operation), (method, path, status, response.text[:500])
        assert status != 500, response.text[:500]
        if status != 200:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        elif path == "/v1/images/generations":
            if response.headers["content-type"].startswith("text/event-stream"):
                assert response.text.startswith("event: image_generation.")
            else:
                assert response.json()["data"]

    exchange()
    # the fuzz reached the engine and was refused in the documented ways; whether a drawn body
    # passes the body limit depends on the schema's shape, so that refusal is asked for too
    statuses = {status for (path, status) in seen if path == "/v1/images/generations"}
    assert {200, 400, 401} <= statuses, seen
    oversized = b'{"prompt": "' + b"a" * MAX_BODY + b'"}'
    for _ in range(20):  # the fuzz may have spent the caller's rate bucket: wait as told
        response = loop.run_until_complete(http.post("/v1/images/generations", content=oversized, headers={
            "authorization": f"Bearer {KEY}", "content-type": "application/json"}))
        if response.status_code != 429:
            break
        time.sleep(max(0.05, float(response.headers.get("retry-after", 0))))
    assert response.status_code == 413 and response.json()["error"]["message"], response.text[:500]
    # alive afterwards: a plain request works, and nothing of ours is left on the engine
    # (the fuzz may have spent the caller's rate bucket: a well-behaved client waits as told)
    for _ in range(20):
        response = loop.run_until_complete(http.post("/v1/images/generations",
                                                      headers={"authorization": f"Bearer {KEY}"},
                                                      json={"prompt": "a red circle", "steps": 2}))
        if response.status_code != 429:
            break
        time.sleep(max(0.05, float(response.headers.get("retry-after", 0))))
    assert response.status_code == 200, response.text
    assert loop.run_until_complete(http.get("/health")).status_code == 200
    assert link.callers <= link.max_callers
    with Client(engine.address) as direct:
        wait_until(lambda: direct.stats()["requests_in_flight"] == 0, 10, message="no request left on the engine")
