"""diffslot client library: `Client`, `AsyncClient` and the messages they return."""
from engine.protocol import (
    Accepted, Canceled, Completed, Control, Failed, GenerateParams, PartialImage, Progress, Rejected, StepCache,
    Timings,
)
from frontend.async_client import AsyncClient
from frontend.client import AuthenticationError, Client, EngineDeadError
from frontend.request_handle import RequestHandle

__all__ = [
    "Client", "AsyncClient", "RequestHandle", "GenerateParams", "StepCache", "Control", "Accepted", "Progress",
    "PartialImage",
    "Completed", "Canceled", "Rejected", "Failed", "Timings", "EngineDeadError", "AuthenticationError",
]
