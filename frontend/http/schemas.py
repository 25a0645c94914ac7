"""Request bodies of the images API (msgspec: decoding is the gateway's per-request cost,
and msgspec keeps it in microseconds); the responses are in `frontend.http.responses`.

`ImageGenerationRequest` is OpenAI's `POST /v1/images/generations` body plus the
engine's knobs as extra fields (`steps`, `sampler`, `guidance`, `seed`,
`negative_prompt`), which the `openai` package sends through `extra_body`.
`parse_generation` decodes and checks it and turns it into the engine's
`GenerateParams`, one per image; anything wrong is a 400 naming the parameter.
`ImageEditRequest` is OpenAI's `POST /v1/images/edits` form (multipart: `image`,
`mask` files and text fields) plus `strength` and the same knobs; `parse_edit` reads
the form (`parse_form`, also the `openai` package's `extra_body` forms `loras[NAME]` and
`original_size[]`) and checks it the same way. Both take the engine's per-request extras
`loras`, `true_cfg`, `original_size`, `crops_coords_top_left` and `target_size`.
`check_fits` refuses, with a 400 naming `n`, `size` or `partial_images`, a request
whose images could never fit in one caller's output budget on the engine (a 429
would tell the client to retry something that can never succeed).

The field annotations (descriptions, ranges, patterns, examples) only document the
body in the OpenAPI schema (`openapi_components`); they do not change decoding, so
a bad value is still the gateway's own 400 naming the parameter, as OpenAI answers.
"""
from __future__ import annotations

import email.message
import io
import json
import math
import re
import secrets
from typing import Annotated, Any

import msgspec

from engine.protocol import (FILE_FIELDS, MAX_PARTIAL_IMAGES, MICRO_CONDITIONING, SAMPLERS, Control, GenerateParams,
                             StepCache, output_nbytes)
from frontend.http.errors import APIError, bad_request
from frontend.http.priorities import priority_value

MAX_N = 10  # OpenAI's own limit on `n`

SEED_LIMIT = 2**63  # the engine's seeds are in [0, 2**63)
INT64 = 2**63  # integers travel to the engine as msgpack int64: larger ones cannot be sent at all
SIZE_PATTERN = r"^\s*\d{1,5}\s*[xX×]\s*\d{1,5}\s*$|^auto$"
_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX×]\s*(\d{1,5})\s*$")
_DECODE_PATH = re.compile(r"at `\$\.(\w+)")
_UNKNOWN_FIELD = re.compile(r"unknown field `(\w+)`")
_MISSING_FIELD = re.compile(r"missing required field `(\w+)`")


def _doc(description: str, **schema) -> msgspec.Meta:
    """Documentation for the OpenAPI schema only (see the module docstring)."""
    examples = schema.pop("examples", None)
    return msgspec.Meta(description=description, examples=examples, extra_json_schema=schema or None)


class ImageGenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt: Annotated[str, _doc("The text to draw (a class name for class-conditional models).",
                                examples=["a red circle"])]
    model: Annotated[str | None, _doc("The served model's id (GET /v1/models; 'diffslot' always names it); "
                                      "absent: that model.", examples=["diffslot"])] = None
    n: Annotated[int | None, _doc("Images to generate, with seeds seed … seed+n−1.", minimum=1, maximum=MAX_N)] \
        = None
    size: Annotated[str | None, _doc("'WIDTHxHEIGHT' or 'auto' (the model's native size).", pattern=SIZE_PATTERN,
                                     examples=["32x32", "auto"])] = None
    response_format: Annotated[str | None, _doc("'b64_json' (the PNG in the response) or 'url' (a link to it in "
                                                "the gateway's output store, valid for a limited time).",
                                                enum=["b64_json", "url"])] = None
    output_format: Annotated[str | None, _doc("Only 'png'.", enum=["png"])] = None
    stream: Annotated[bool | None, _doc("Server-sent image events (n must be 1).")] = None
    partial_images: Annotated[int | None, _doc("Previews to stream before the image (with stream).", minimum=0,
                                               maximum=MAX_PARTIAL_IMAGES)] = None
    # accepted for compatibility with OpenAI clients; they do not change the image
    quality: str | None = None
    style: str | None = None
    background: Annotated[str | None, _doc("'auto' or 'opaque'.", enum=["auto", "opaque"])] = None
    moderation: str | None = None
    output_compression: int | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # the engine's knobs (None: the engine's default; seed None: a fresh random seed)
    steps: Annotated[int | None, _doc("Denoising steps (the engine's maximum applies).", minimum=1,
                                      examples=[20])] = None
    sampler: Annotated[str | None, _doc("The sampler.", enum=list(SAMPLERS))] = None
    guidance: Annotated[float | None, _doc("Classifier-free guidance scale (the engine's maximum applies).",
                                           minimum=0, examples=[3.0])] = None
    seed: Annotated[int | None, _doc("The first image's seed; absent: a random one.", minimum=0,
                                     maximum=SEED_LIMIT - 1)] = None
    negative_prompt: Annotated[str | None, _doc("Conditions the unconditional branch of guidance.")] = None
    # the engine's per-request extras (the `openai` package's `extra_body`)
    loras: Annotated[dict[str, float] | None, _doc("LoRA adapters (GET /v1/models lists them) → scale.",
                                                   examples=[{"A": 0.8}])] = None
    true_cfg: Annotated[float | None, _doc("FLUX: the pipeline's true_cfg_scale (with negative_prompt).")] = None
    cache: Annotated[StepCache | None, _doc(
        "A step cache for this request (transformer models): kind first_block, mag, taylorseer or off, with the "
        "parameters of diffusers' config of that kind; absent: the server's default.",
        examples=[{"kind": "first_block", "threshold": 0.1}])] = None
    controls: Annotated[tuple[Control, ...] | None, _doc(
        "ControlNets (GET /v1/models lists them, type controlnet), each {name, image: the control image as base64 "
        "PNG/JPEG/WebP, scale, start, end}; several are summed as diffusers' multi-ControlNet.",
        examples=[[{"name": "edges", "image": "<base64 PNG>", "scale": 0.8}]])] = None
    guess_mode: Annotated[bool | None, _doc("SD/SDXL ControlNet guess mode (with controls).")] = None
    ip_image: Annotated[bytes | None, _doc("IP-Adapter: an image as a prompt, base64 PNG/JPEG/WebP (the engine's "
                                           "--ip-adapter); in the edits form, a file.")] = None
    ip_scale: Annotated[float | None, _doc("The IP-Adapter's scale (with ip_image; default 1).")] = None
    original_size: Annotated[tuple[int, int] | None, _doc("SDXL micro-conditioning: [height, width].")] = None
    crops_coords_top_left: Annotated[tuple[int, int] | None, _doc("SDXL micro-conditioning: [top, left].")] = None
    target_size: Annotated[tuple[int, int] | None, _doc("SDXL micro-conditioning: [height, width].")] = None
    # scheduling on the engine
    priority: Annotated[int | str | None, _doc(
        "A class ('batch', 'default', 'interactive') or an integer, higher first; absent: the caller's default "
        "class. Capped at the caller's ceiling (the x-diffslot-priority header says what it ran at).",
        examples=["interactive"])] = None
    deadline_s: Annotated[float | None, _doc("Seconds after arrival by which the image is wanted: orders requests "
                                             "of one priority by slack.", exclusiveMinimum=0)] = None


class ImageEditRequest(ImageGenerationRequest, kw_only=True, forbid_unknown_fields=True):
    """The text fields of OpenAI's edits form, and the engine's `strength`. The `image`
    and `mask` files are not part of it (parse_edit takes them from the form)."""

    strength: Annotated[float | None, _doc("How far from the image to start: (0, 1]; absent: the model's image "
                                           "pipeline's default.", exclusiveMinimum=0, maximum=1)] = None
    input_fidelity: str | None = None  # accepted for compatibility; it does not change the image


#: the extras that are not plain values: JSON text in a form, or the `openai` package's `x[...]` fields
STRUCTURED_FIELDS = ("loras", "cache", "controls", *MICRO_CONDITIONING)
EXTRA_FIELDS = ("loras", "true_cfg", "cache", "controls", "guess_mode", "ip_image", "ip_scale", *MICRO_CONDITIONING)


class Generation(msgspec.Struct, frozen=True):
    """A checked request: what to submit and how to answer."""

    model: str
    params: tuple[GenerateParams, ...]  # one per image, seeds seed … seed+n−1
    size: str  # "WxH" as echoed back, "auto" where the model's native size is used
    stream: bool
    partial_images: int
    event: str = "image_generation"  # the SSE event prefix: "image_edit" for edits
    default_hw: tuple[int, int] | None = None  # (height, width) of the output when size is absent (an edit's image)
    priority: int | None = None  # asked for (checked, not yet capped: `with_priority`); None: the caller's default
    response_format: str = "b64_json"  # or "url": the images go to the output store, the response links them
    adapter: str | None = None  # the LoRA adapter `model` named, if it named one

    def with_priority(self, priority: int) -> "Generation":
        """The same request at the engine priority it runs at."""
        params = tuple(msgspec.structs.replace(p, priority=priority) for p in self.params)
        return msgspec.structs.replace(self, params=params)


_decoder = msgspec.json.Decoder(ImageGenerationRequest)


def decode_error(exc: msgspec.DecodeError | msgspec.ValidationError) -> APIError:
    text = str(exc)
    for pattern in (_UNKNOWN_FIELD, _MISSING_FIELD, _DECODE_PATH):
        match = pattern.search(text)
        if match:
            param = match.group(1)
            within = _DECODE_PATH.search(text)
            if pattern is not _DECODE_PATH and within:  # a field of a nested object: named by its path
                param = f"{within.group(1)}.{param}"
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


def parse_generation(body: bytes, served_models: tuple[str, ...], adapters_as_models: bool = False) -> Generation:
    """Decode and check a request body; raises APIError (400/404) naming the parameter.
    `adapters_as_models`: a `model` that is not the served one names a LoRA adapter
    (`Generation.adapter`; the caller checks that the engine has it)."""
    try:
        req = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise decode_error(exc) from None
    return _generation(req, served_models, adapters_as_models)


def _generation(req: ImageGenerationRequest, served_models: tuple[str, ...], adapters_as_models: bool = False,
                **inputs) -> Generation:
    adapter = None
    if req.model not in (None, "") and req.model not in served_models and adapters_as_models:
        # an adapter addressed as a model (vLLM's convention): the adapter at scale 1 beside any named in loras
        adapter = req.model
        req = msgspec.structs.replace(req, loras={adapter: 1.0, **(req.loras or {})})
    elif req.model not in (None, "") and req.model not in served_models:
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves "
                            f"{', '.join(repr(m) for m in served_models[:1])}.", param="model", code="model_not_found")
    if req.response_format not in (None, "b64_json", "url"):
        raise bad_request(f"Invalid value for 'response_format': {req.response_format!r}; supported: 'b64_json', "
                          f"'url'.", "response_format")
    priority = None if req.priority is None else priority_value(req.priority)
    if req.deadline_s is not None and not (math.isfinite(req.deadline_s) and req.deadline_s > 0):
        raise bad_request(f"Invalid value for 'deadline_s': {req.deadline_s!r}; must be a positive number of "
                          f"seconds.", "deadline_s")
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
    if stream and req.response_format == "url":
        raise bad_request("Streaming sends the images themselves: use response_format 'b64_json' with 'stream'.",
                          "response_format", "unsupported_value")
    if stream and n != 1:
        raise bad_request("Streaming supports one image per request ('n': 1).", "n", "unsupported_value")
    height, width = parse_size(req.size)
    for name in ("steps", "output_compression"):
        value = getattr(req, name)
        if value is not None and not -INT64 <= value < INT64:
            raise bad_request(f"Invalid value for '{name}': {value} is out of range.", name)
    if req.seed is not None and not (0 <= req.seed and req.seed + n - 1 < SEED_LIMIT):
        # checked for every image before any is submitted, so that no image of a refused
        # request ever reaches the engine
        what = "seed" if n == 1 else f"seed … seed+{n - 1} (one seed per image)"
        raise bad_request(f"Invalid value for 'seed': {what} must lie in [0, 2**63).", "seed")
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
    knobs = {name: value for name, value in (("steps", req.steps), ("sampler", req.sampler),
                                             ("guidance", req.guidance), ("negative_prompt", req.negative_prompt))
             if value is not None}
    for name in EXTRA_FIELDS:
        value = getattr(req, name)
        if value is None or value == {}:
            continue
        if name in MICRO_CONDITIONING and not all(-INT64 <= v < INT64 for v in value):
            raise bad_request(f"Invalid value for '{name}': {list(value)} is out of range.", name)
        knobs[name] = value
    if req.deadline_s is not None:
        knobs["deadline_s"] = req.deadline_s
    knobs.update({name: value for name, value in inputs.items() if value is not None})
    try:
        params = tuple(GenerateParams(prompt=req.prompt, seed=seed + i, output="png", height=height, width=width,
                                      **knobs) for i in range(n))
    except (TypeError, ValueError) as exc:  # GenerateParams does not validate; kept for safety
        raise bad_request(str(exc)) from None
    size = "auto" if height is None else f"{width}x{height}"
    return Generation(model=req.model or served_models[0], params=params, size=size, stream=stream, adapter=adapter,
                      partial_images=partial, event="image_edit" if "image" in inputs else "image_generation",
                      default_hw=_header_size(inputs.get("image")), priority=priority,
                      response_format=req.response_format or "b64_json")


def _header_size(data: bytes | None) -> tuple[int, int] | None:
    """(height, width) from an image's header, None if it has none (the engine then says why)."""
    if data is None:
        return None
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
        return height, width
    except Exception:
        return None


# ----------------------------------------------------------------------------- the edits form

_MULTIPART = re.compile(r"^\s*multipart/form-data\s*(;|$)", re.IGNORECASE)
_INDEXED = re.compile(r"^(\w+)\[(\w*)\]$")  # the openai package's `loras[A]` and `original_size[]`
_edit_fields = set(ImageEditRequest.__struct_fields__)


def _header_params(value: str) -> email.message.Message:
    message = email.message.Message()
    message["content-type"] = value
    return message


#: parts a multipart form may have: every field of an edit (loras by name included) many times over
MAX_FORM_PARTS = 256


def form_parts(content_type: str, body: bytes,
               files: str = "the image and mask as files") -> list[tuple[str, str | None, bytes]]:
    """A multipart/form-data body's parts as (field name, file name or None, content).
    Raises APIError (400) when the body is not such a form (`files`: what it should carry)."""
    if not _MULTIPART.match(content_type or ""):
        raise bad_request(f"The request body must be multipart/form-data ({files}).", None, "invalid_content_type")
    boundary = _header_params(content_type).get_param("boundary")
    if not isinstance(boundary, str) or not 0 < len(boundary) <= 200:
        raise bad_request("The multipart/form-data body has no boundary.", None, "invalid_multipart")
    delimiter = b"\r\n--" + boundary.encode("latin-1")
    parts_given = body.count(delimiter) + body.startswith(delimiter[2:]) - 1
    if parts_given > MAX_FORM_PARTS:
        raise bad_request(f"The multipart/form-data body has {parts_given} parts, more than this server reads "
                          f"({MAX_FORM_PARTS}).", None, "too_many_parts")
    sections = (b"\r\n" + body).split(delimiter)
    if len(sections) < 2 or not sections[-1].startswith(b"--"):
        raise bad_request("The multipart/form-data body is truncated or malformed.", None, "invalid_multipart")
    parts = []
    for section in sections[1:-1]:
        head_end = section.find(b"\r\n\r\n")
        if head_end < 0:
            raise bad_request("A multipart/form-data part has no headers.", None, "invalid_multipart")
        name, filename = None, None
        for line in section[:head_end].decode("latin-1").split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-disposition":
                disposition = _header_params("form-data" + value[value.find(";"):] if ";" in value else value)
                name, filename = disposition.get_param("name"), disposition.get_param("filename")
        if not isinstance(name, str) or not name:
            raise bad_request("A multipart/form-data part has no field name.", None, "invalid_multipart")
        parts.append((name, filename if isinstance(filename, str) else None, section[head_end + 4:]))
    return parts


def parse_form(content_type: str, body: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A multipart/form-data body as (text fields, files). Repeated names and the
    bracketed forms become lists (`x[]`) and objects (`x[key]`); any field may be a file
    part or a text part. Raises APIError (400) naming the field where there is one."""
    fields: dict[str, Any] = {}
    files: dict[str, bytes] = {}
    for name, filename, content in form_parts(content_type, body):
        indexed = _INDEXED.match(name)
        base = indexed.group(1) if indexed else name
        if base in FILE_FIELDS:
            if base in files:
                raise bad_request(f"One '{base}' only: this server edits one image per request.", base,
                                  "unsupported_value")
            files[base] = content
            continue
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            raise bad_request(f"Invalid value for '{base}': not UTF-8 text"
                              f"{' (a file where text belongs)' if filename is not None else ''}.", base) from None
        if indexed is None:
            if name in fields:
                raise bad_request(f"Parameter '{name}' given more than once.", name)
            fields[name] = text
        elif indexed.group(2):  # x[key]: an object
            target = fields.setdefault(base, {})
            if not isinstance(target, dict) or indexed.group(2) in target:
                raise bad_request(f"Invalid value for '{base}'.", base)
            target[indexed.group(2)] = text
        else:  # x[]: a list
            target = fields.setdefault(base, [])
            if not isinstance(target, list):
                raise bad_request(f"Invalid value for '{base}'.", base)
            target.append(text)
    return fields, files


_JSON_SHAPES = {"loras": "an object", "cache": "an object", "controls": "a list of objects"}


def parse_edit(content_type: str, body: bytes, served_models: tuple[str, ...], max_input_bytes: int,
               adapters_as_models: bool = False) -> Generation:
    """Read and check an edits form; raises APIError (400/404) naming the parameter.
    Values are text in a form: numbers and booleans are read from it, the structured
    extras from JSON text (`loras={"A": 0.8}`) or the bracketed fields."""
    fields, files = parse_form(content_type, body)
    for name in fields:
        if name not in _edit_fields:
            raise bad_request(f"Unknown parameter: '{name}'.", name, "unknown_parameter")
    for name in STRUCTURED_FIELDS:
        value = fields.get(name)
        if isinstance(value, str):
            try:
                fields[name] = json.loads(value)
            except ValueError:
                raise bad_request(f"Invalid value for '{name}': expected JSON "
                                  f"({_JSON_SHAPES.get(name, '[a, b]')}).", name) from None
    try:
        req = msgspec.convert(fields, ImageEditRequest, strict=False)
    except msgspec.ValidationError as exc:
        raise decode_error(exc) from None
    if files.get("image") is None:
        raise bad_request("Missing required parameter: 'image' (the image to edit, as a file).", "image",
                          "missing_required_parameter")
    for name, data in files.items():
        if not data:
            raise bad_request(f"Invalid value for '{name}': the file is empty.", name)
        if max_input_bytes and len(data) > max_input_bytes:
            raise bad_request(f"Invalid value for '{name}': {len(data)} bytes, more than the engine takes "
                              f"({max_input_bytes} bytes per file).", name)
    return _generation(req, served_models, adapters_as_models, strength=req.strength, **files)


def image_bytes(params: GenerateParams, native_size: int, default_hw: tuple[int, int] | None = None) -> int:
    """The engine's reservation for one PNG of this request (engine.protocol.output_nbytes)."""
    default_h, default_w = default_hw or (native_size, native_size)
    height, width = params.height or default_h, params.width or default_w
    return output_nbytes("png", height, width, ())


def check_fits(gen: Generation, budget_bytes: int, native_size: int) -> None:
    """400 naming the parameter when the request's images (and previews, which are
    full-size PNGs) can never be held at once within one caller's output budget on the
    engine (`Welcome.output_budget_bytes`), however idle the engine is."""
    if budget_bytes <= 0 or native_size <= 0:  # an engine that does not say: it decides
        return
    params = gen.params[0]
    one = image_bytes(params, native_size, gen.default_hw)
    default_h, default_w = gen.default_hw or (native_size, native_size)
    size = f"{params.width or default_w}x{params.height or default_h}"
    limit = f"the {budget_bytes} bytes of output one caller may hold on the engine"
    if one > budget_bytes:
        if gen.default_hw is not None and params.height is None and params.width is None:  # the image's own size
            raise bad_request(f"Invalid value for 'image': its size, {size}, is the output's, whose image needs up "
                              f"to {one} bytes, more than {limit}; send a smaller image or ask for a smaller "
                              f"'size'.", "image")
        raise bad_request(f"Invalid value for 'size': one {size} image needs up to {one} bytes, more than {limit}; "
                          f"ask for a smaller size.", "size")
    with_previews = one * (1 + gen.partial_images)
    if with_previews > budget_bytes:
        fits = budget_bytes // one - 1
        raise bad_request(f"Invalid value for 'partial_images': a {size} image and {gen.partial_images} previews "
                          f"need up to {with_previews} bytes, more than {limit}; at most {fits} previews fit at "
                          f"this size.", "partial_images")
    total = one * len(gen.params)
    if total > budget_bytes:
        raise bad_request(f"Invalid value for 'n': {len(gen.params)} images of {size} need up to {total} bytes at "
                          f"once, more than {limit}; at most {budget_bytes // one} fit at this size.", "n")
