"""Response bodies of the images API (OpenAI's `ImagesResponse`, its streaming events, the
model list) encoded straight from dicts by msgspec, and the pieces of the gateway's
OpenAPI document: the response structs (for the schema only), shared error responses."""
from __future__ import annotations

import time

import msgspec

from engine.protocol import Timings
from frontend.http.schemas import ImageEditRequest, ImageGenerationRequest

_encoder = msgspec.json.Encoder()
_EMPTY_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
                "output_tokens": 0, "total_tokens": 0}


def timings_dict(t: Timings) -> dict:
    return {"queue_s": t.queue_s, "encode_s": t.encode_s, "denoise_s": t.denoise_s,
            "decode_wait_s": t.decode_wait_s, "decode_s": t.decode_s, "total_s": t.total_s,
            "evals": t.evals, "padded_evals": t.padded_evals, "image_encode_s": t.image_encode_s}


def images_response(images: list[tuple[str, int, Timings]], size: str, created: int | None = None,
                    image_field: str = "b64_json") -> bytes:
    """OpenAI's ImagesResponse: `created`, `data: [{b64_json}]` (or `[{url}]` with
    `image_field="url"`), `output_format`, `size`; the engine's per-image timings and
    seeds ride as the extra fields `timings` and `data[i].seed`."""
    return _encoder.encode(images_body(images, size, created, image_field))


def images_body(images: list[tuple[str, int, Timings]], size: str, created: int | None = None,
                image_field: str = "b64_json") -> dict:
    """`images_response` before encoding (a batch line's response body)."""
    return {
        "created": int(time.time()) if created is None else created,
        "data": [{image_field: value, "seed": seed} for value, seed, _ in images],
        "output_format": "png",
        "background": "opaque",
        "size": size,
        "timings": [timings_dict(t) for _, _, t in images],
    }


def partial_image_event(b64: str, index: int, size: str, step: int | None = None, total: int | None = None,
                        kind: str = "image_generation") -> bytes:
    event = {"type": f"{kind}.partial_image", "b64_json": b64, "partial_image_index": index,
             "created_at": int(time.time()), "size": size, "quality": "auto", "background": "opaque",
             "output_format": "png"}
    if step is not None:
        event["step"], event["total_steps"] = step, total
    return sse(f"{kind}.partial_image", event)


def completed_event(b64: str, size: str, timings: Timings, seed: int, kind: str = "image_generation") -> bytes:
    return sse(f"{kind}.completed", {
        "type": f"{kind}.completed", "b64_json": b64, "created_at": int(time.time()), "size": size,
        "quality": "auto", "background": "opaque", "output_format": "png", "usage": _EMPTY_USAGE,
        "seed": seed, "timings": timings_dict(timings)})


def sse(event: str, data: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"


def models_response(models: tuple[str, ...], created: int, adapters: list[str] = (),
                    controlnets: list[str] = ()) -> bytes:
    """The served model, then its LoRA adapters (`parent`: the model; ask for one with
    `extra_body={"loras": {name: scale}}`), as vLLM lists its LoRA modules, then its
    ControlNets (`extra_body={"controls": [{"name": name, "image": base64}]}`)."""
    data = [{"id": m, "object": "model", "created": created, "owned_by": "diffslot"} for m in models]
    data += [{"id": name, "object": "model", "created": created, "owned_by": "diffslot", "type": kind,
              "parent": models[0] if models else None}
             for kind, names in (("lora", adapters), ("controlnet", controlnets)) for name in names]
    return _encoder.encode({"object": "list", "data": data})


# ----------------------------------------------------------------------------- the OpenAPI schema
# Structs of the responses, for the schema only: the responses themselves are encoded
# from dicts above (the same fields).


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every non-200 answer: OpenAI's error shape."""

    error: ErrorBody


class ImageData(msgspec.Struct):
    seed: int
    b64_json: str | None = None  # response_format 'b64_json'
    url: str | None = None  # response_format 'url'



class ImagesResponse(msgspec.Struct):
    created: int
    data: list[ImageData]
    output_format: str
    background: str
    size: str
    timings: list[dict]


class Model(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str
    type: str | None = None  # "lora" for an adapter, "controlnet" for a ControlNet
    parent: str | None = None  # an adapter's model


class ModelList(msgspec.Struct):
    object: str
    data: list[Model]


class Health(msgspec.Struct):
    status: str
    engine_pid: int
    model: str


SCHEMA_REF = "#/components/schemas/{name}"


def openapi_components(more: tuple[type, ...] = ()) -> dict[str, dict]:
    """`components.schemas` of the gateway's OpenAPI document (`more`: other routes' structs)."""
    _, components = msgspec.json.schema_components(
        [ImageGenerationRequest, ImageEditRequest, ErrorResponse, ImagesResponse, ModelList, Health, *more],
        ref_template=SCHEMA_REF)
    return components


def schema_ref(struct: type) -> dict:
    return {"$ref": SCHEMA_REF.format(name=struct.__name__)}


ERROR_DESCRIPTIONS = {
    400: "A malformed body, or a value the engine cannot take (`param` names it; also a request "
         "whose images could never fit in a caller's output budget: `n`, `size` or `partial_images`)",
    401: "A missing or wrong API key (only when the server has API keys)",
    403: "The link's signature is wrong or it has expired",
    404: "An unknown model",
    409: "The object is in a state that does not allow this",
    413: "The request body is larger than the server's limit",
    429: "This caller's rate limit, or the engine's queue or this caller's share of it is full "
         "(`Retry-After`)",
    500: "The engine could not finish the request; details in the server's log under the request id",
    503: "No engine is reachable, or the engine is draining",
}


def error_responses(*statuses: int, notes: dict[int, str] | None = None) -> dict:
    """OpenAPI `responses` for these error statuses (`notes`: a route's own descriptions)."""
    error = {"application/json": {"schema": schema_ref(ErrorResponse)}}
    descriptions = {**ERROR_DESCRIPTIONS, **(notes or {})}
    return {status: {"description": descriptions[status], "content": error} for status in statuses}


def ok_response(description: str, content: dict) -> dict:
    return {200: {"description": description, "content": content}}
