"""The OpenAI-compatible images API: `python -m frontend http --engine ADDR`.

`app.py` the routes, `schemas.py` the request bodies, `responses.py` the response
bodies and the OpenAPI pieces, `errors.py` OpenAI's error shapes, `link.py` the engine
connections (one per caller), `callers.py` API keys, rate limits and the body limit,
`metrics.py` the gateway's Prometheus metrics, `options.py` the gateway's options and
their flags, `server.py` the CLI (uvicorn). Imported lazily:
`python -m frontend generate` does not pay for FastAPI."""

__all__ = ["create_app", "EngineLink"]


def __getattr__(name):
    if name == "create_app":
        from frontend.http.app import create_app

        return create_app
    if name == "EngineLink":
        from frontend.http.link import EngineLink

        return EngineLink
    raise AttributeError(name)
