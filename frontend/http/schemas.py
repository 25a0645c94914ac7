"""Request and response bodies of the images API (msgspec: decoding and encoding are
the gateway's per-request cost, and msgspec keeps it in microseconds).

`ImageGenerationRequest` is OpenAI's `POST /v1/images/generations` body plus the
engine's knobs as extra fields (`steps`, `sampler`, `guidance`, `seed`,
`negative_prompt`), which the `openai` package sends through `extra_body`.
`parse_generation` decodes and checks it and turns it into the engine's
`GenerateParams`, one per image; anything wrong is a 400 naming the parameter.
"""
from __future__ import annotations

import re
import secrets
import time

import msgspec

from engine.protocol import GenerateParams, Timings
from frontend.http.errors import APIError, bad_request

MAX_N = 10  # OpenAI's own limit on `n`
MAX_PARTIAL_IMAGES = 3
_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX×]\s*(\d{1,5})\s*$")
_DECODE_PATH = re.compile(r"at `\$\.(\w+)")
_UNKNOWN_FIELD = re.compile(r"unknown field `(\w+)`")
_MISSING_FIELD = re.compile(r"missing required field `(\w+)`")


class ImageGenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt: str
    model: str | None = None
    n: int | None = None
    size: str | None = None
    response_format: str | None = None
    output_format: str | None = None
    stream: bool | None = None
    partial_images: int | None = None
    # accepted for compatibility with OpenAI clients; they do not change the image
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    output_compression: int | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # the engine's knobs (None: the engine's default; seed None: a fresh random seed)
    steps: int | None = None
    sampler: str | None = None
    guidance: float | None = None
    seed: int | None = None
    negative_prompt: str | None = None


class Generation(msgspec.Struct, frozen=True):
    """A checked request: what to submit and how to answer."""

    model: str
    params: tuple[GenerateParams, ...]  # one per image, seeds seed … seed+n−1
    size: str  # "WxH" as echoed back, "auto" where the model's native size is used
    stream: bool
    partial_images: int


_decoder = msgspec.json.Decoder(ImageGenerationRequest)


def decode_error(exc: msgspec.DecodeError | msgspec.ValidationError) -> APIError:
    text = str(exc)
    for pattern in (_UNKNOWN_FIELD, _MISSING_FIELD, _DECODE_PATH):
        match = pattern.search(text)
        if match:
            param = match.group(1)
            if pattern is _UNKNOWN_FIELD:
                return bad_request(f"Unknown parameter: '{param}'.", param, "unknown_parameter")
            if pattern is _MISSING_FIELD:
                return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
            return bad_request(f"Invalid type for '{param}': {text.split(' - at ')[0]}.", param, "invalid_type")
    if isinstance(exc, msgspec.ValidationError):
        return bad_request(f"The request body must be a JSON object: {text}.", None, "invalid_type")
    return bad_request(f"The request body is not valid JSON: {text}.", None, "invalid_json")


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """(height, width); (None, None) for "auto" or absent: the model's native size."""
    if size is None or size.strip().lower() == "auto":
        return None, None
    match = _SIZE.match(size)
    if not match:
        raise bad_request(f"Invalid value for 'size': {size!r}; expected 'WIDTHxHEIGHT' (e.g. '512x512') or 'auto'.",
                          "size")
    width, height = int(match.group(1)), int(match.group(2))
    return height, width


def parse_generation(body: bytes, served_models: tuple[str, ...]) -> Generation:
    """Decode and check a request body; raises APIError (400/404) naming the parameter."""
    try:
        req = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise decode_error(exc) from None
    if req.model not in (None, "") and req.model not in served_models:
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves "
                            f"{', '.join(repr(m) for m in served_models[:1])}.", param="model", code="model_not_found")
    if req.response_format not in (None, "b64_json"):
        if req.response_format == "url":
            raise bad_request("response_format 'url' is not supported: this server keeps no images to link to; "
                              "use response_format 'b64_json' (the PNG, base64-encoded, in the response).",
                              "response_format", "unsupported_value")
        raise bad_request(f"Invalid value for 'response_format': {req.response_format!r}; supported: 'b64_json'.",
                          "response_format")
    if req.output_format not in (None, "png"):
        raise bad_request(f"Invalid value for 'output_format': {req.output_format!r}; supported: 'png'.",
                          "output_format", "unsupported_value")
    if req.background not in (None, "auto", "opaque"):
        raise bad_request(f"Invalid value for 'background': {req.background!r}; supported: 'auto', 'opaque'.",
                          "background", "unsupported_value")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"Invalid value for 'n': {n}; must be between 1 and {MAX_N}.", "n")
    stream = bool(req.stream)
    partial = 0 if req.partial_images is None else req.partial_images
    if not 0 <= partial <= MAX_PARTIAL_IMAGES:
        raise bad_request(f"Invalid value for 'partial_images': {partial}; must be between 0 and "
                          f"{MAX_PARTIAL_IMAGES}.", "partial_images")
    if partial and not stream:
        raise bad_request("'partial_images' requires 'stream': true.", "partial_images")
    if stream and n != 1:
        raise bad_request("Streaming supports one image per request ('n': 1).", "n", "unsupported_value")
    height, width = parse_size(req.size)
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
    knobs = {name: value for name, value in (("steps", req.steps), ("sampler", req.sampler),
                                             ("guidance", req.guidance), ("negative_prompt", req.negative_prompt))
             if value is not None}
    try:
        params = tuple(GenerateParams(prompt=req.prompt, seed=seed + i, output="png", height=height, width=width,
                                      **knobs) for i in range(n))
    except (TypeError, ValueError) as exc:  # GenerateParams does not validate; kept for safety
        raise bad_request(str(exc)) from None
    size = "auto" if height is None else f"{width}x{height}"
    return Generation(model=req.model or served_models[0], params=params, size=size, stream=stream,
                      partial_images=partial)


# ----------------------------------------------------------------------------- responses

_encoder = msgspec.json.Encoder()
_EMPTY_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
                "output_tokens": 0, "total_tokens": 0}


def timings_dict(t: Timings) -> dict:
    return {"queue_s": t.queue_s, "encode_s": t.encode_s, "denoise_s": t.denoise_s,
            "decode_wait_s": t.decode_wait_s, "decode_s": t.decode_s, "total_s": t.total_s,
            "evals": t.evals, "padded_evals": t.padded_evals}


def images_response(images: list[tuple[str, int, Timings]], size: str, created: int | None = None) -> bytes:
    """OpenAI's ImagesResponse: `created`, `data: [{b64_json}]`, `output_format`, `size`;
    the engine's per-image timings and seeds ride as the extra fields `timings` and
    `data[i].seed`."""
    return _encoder.encode({
        "created": int(time.time()) if created is None else created,
        "data": [{"b64_json": b64, "seed": seed} for b64, seed, _ in images],
        "output_format": "png",
        "background": "opaque",
        "size": size,
        "timings": [timings_dict(t) for _, _, t in images],
    })


def partial_image_event(b64: str, index: int, size: str, step: int | None = None, total: int | None = None) -> bytes:
    event = {"type": "image_generation.partial_image", "b64_json": b64, "partial_image_index": index,
             "created_at": int(time.time()), "size": size, "quality": "auto", "background": "opaque",
             "output_format": "png"}
    if step is not None:
        event["step"], event["total_steps"] = step, total
    return sse("image_generation.partial_image", event)


def completed_event(b64: str, size: str, timings: Timings, seed: int) -> bytes:
    return sse("image_generation.completed", {
        "type": "image_generation.completed", "b64_json": b64, "created_at": int(time.time()), "size": size,
        "quality": "auto", "background": "opaque", "output_format": "png", "usage": _EMPTY_USAGE,
        "seed": seed, "timings": timings_dict(timings)})


def sse(event: str, data: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"


def models_response(models: tuple[str, ...], created: int) -> bytes:
    return _encoder.encode({"object": "list", "data": [
        {"id": m, "object": "model", "created": created, "owned_by": "diffslot"} for m in models]})
