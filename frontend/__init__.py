"""diffslot client library: `Client`, `AsyncClient` and the messages they return."""
from engine.protocol import (
    Accepted, Canceled, Completed, Failed, GenerateParams, Progress, Rejected, Timings,
)
from frontend.client import AsyncClient, Client, EngineDeadError, RequestHandle

__all__ = [
    "Client", "AsyncClient", "RequestHandle", "GenerateParams", "Accepted", "Progress", "Completed",
    "Canceled", "Rejected", "Failed", "Timings", "EngineDeadError",
]
