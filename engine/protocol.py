"""Every message that crosses a process boundary, as msgspec Structs.

Wire format: one ZMQ multipart message per protocol message. A client's DEALER sends
one frame, the msgpack body. The engine's ROUTER answers with the body and, for
`Completed`, one extra frame holding the output bytes (PNG, raw uint8 H×W×3 or
float32 C×H×W latent), sent zero-copy and never inside the msgpack body.

Byte-carrying inputs travel the same way in the other direction: every field of
`GenerateParams` typed `bytes` (today `image` and `mask`; a bytes field of a nested
struct too, by its path, e.g. `controls.0.image`) is a frame field. A `Submit` whose
params hold such bytes has them emptied in the body (`split_frames`) and names their
paths in `Submit.inputs`, in the order of the extra frames that follow the body, each
at most `Welcome.max_input_bytes`. The engine's IO thread reattaches them zero-copy
(`attach_frames`) before the busy loop sees the request; a count that does not match,
an unknown or repeated path, or a frame over the limit is `Rejected` naming the field.
The client, the IO thread, the HTTP gateway's upload form and the CLI all derive the
frame fields from `GenerateParams` itself (`FRAME_FIELDS`, `frame_paths`).

Bodies are msgpack arrays whose first element is the message tag (`array_like`
structs in a tagged union), e.g. `["submit", "r1", {"prompt": "a red circle"}]`.
`GenerateParams` stays a msgpack map so users can write it by hand and unknown
fields are caught by name. Decoding validates types; `describe_decode_error` turns
msgspec's error into the field a `Rejected` names.

Handshake: a client sends `Hello(version)` first; the engine answers `Welcome` (or
`Rejected` naming `version`). Both sides send `Heartbeat` every
`Welcome.heartbeat_interval_s`, so either notices the other's death without
request timeouts. A client acknowledges each `Completed` with `Delivered`, which
returns the output bytes to its budget; so does a request that ends otherwise
after its partial images were sent, whose bytes the client held until then.

`Health` is answered by the engine's IO thread, never by the busy loop, so a probe
gets its answer while a long denoising step runs; `HealthReply.alive` says whether the
busy loop is making progress (see engine.serve.heartbeat).
"""
from __future__ import annotations

import functools
import math
import re
from typing import Annotated, Any, Union

import msgspec

PROTOCOL_VERSION = 1
OUTPUT_KINDS = ("png", "uint8", "latent")
# `default`: the model folder's own scheduler; `flow_euler` for flow-matching models
SAMPLERS = ("default", "euler", "euler_ancestral", "ddim", "dpmpp_2m", "flow_euler")
MAX_REQUEST_ID_LEN = 128
MAX_PROMPT_CHARS = 4096  # longer prompts are truncated by every text encoder anyway
MAX_MESSAGE_BYTES = 64 * 1024  # a client message is a few hundred bytes; more is abuse
# Names of the shared-memory segments an engine creates: SEGMENT_PREFIX + "<engine pid>-...",
# so a restarted engine and the tests can tell whose segments are left.
SEGMENT_PREFIX = "diffslot-"

MAX_INPUT_BYTES = 16 << 20  # each input frame (an image, a mask), by default (CoreConfig.max_input_bytes)

#: SDXL's micro-conditioning fields of `GenerateParams`, in `add_time_ids` order
MICRO_CONDITIONING = ("original_size", "crops_coords_top_left", "target_size")

#: `GenerateParams.priority` lies in [-MAX_PRIORITY, MAX_PRIORITY]; the gateway's classes map onto it
MAX_PRIORITY = 1000
PRIORITY_CLASSES = {"batch": -10, "default": 0, "interactive": 10}

MAX_PARTIAL_IMAGES = 3  # previews one request may ask for (`partial_images`, as OpenAI's)

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_LEN)]
PartialImages = Annotated[int, msgspec.Meta(ge=0, le=MAX_PARTIAL_IMAGES)]


#: step-cache kinds: diffusers' cache hooks, each decided per request (and "off")
STEP_CACHE_KINDS = ("first_block", "mag", "taylorseer", "off")


class StepCache(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A request's step cache: one of diffusers' cache hooks, with its config's parameters
    and defaults (None: diffusers' default), decided for this request alone inside the
    shared batch. `kind="off"` turns the server's default (`--cache`) off."""

    kind: str  # first_block (FirstBlockCacheConfig), mag (MagCacheConfig), taylorseer (TaylorSeerCacheConfig), off
    threshold: Annotated[float, msgspec.Meta(ge=0)] | None = None  # first_block (0.05), mag (0.06)
    max_skip_steps: Annotated[int, msgspec.Meta(ge=0, le=1000)] | None = None  # mag (3)
    retention_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None  # mag (0.2)
    # mag: the model's calibrated ratios (default: the model's own)
    mag_ratios: Annotated[tuple[float, ...], msgspec.Meta(min_length=1, max_length=1000)] | None = None
    cache_interval: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None  # taylorseer (5)
    disable_cache_before_step: Annotated[int, msgspec.Meta(ge=0, le=1000)] | None = None  # taylorseer (3)
    disable_cache_after_step: Annotated[int, msgspec.Meta(ge=0, le=1000)] | None = None  # taylorseer (None)
    max_order: Annotated[int, msgspec.Meta(ge=0, le=4)] | None = None  # taylorseer (1)
    factors_dtype: str | None = None  # taylorseer: bfloat16 (diffusers' default), float16 or float32
    # taylorseer (False): TaylorSeer Lite, which skips every block on a prediction step and
    # extrapolates the transformer's output projection instead of each attention's output
    use_lite_mode: bool | None = None


def parse_step_cache(text: str) -> StepCache:
    """`KIND[:THRESHOLD]` or `taylorseer:lite` (the `--cache` flags) → a `StepCache`;
    ValueError saying what is wrong."""
    kind, _, threshold = text.partition(":")
    if kind not in STEP_CACHE_KINDS:
        raise ValueError(f"cache kind {kind!r} is not one of {', '.join(STEP_CACHE_KINDS)}")
    if not threshold:
        return StepCache(kind=kind)
    if kind == "taylorseer" and threshold == "lite":
        return StepCache(kind=kind, use_lite_mode=True)
    if kind not in ("first_block", "mag"):
        raise ValueError(f"cache kind {kind} takes no threshold" + (" (taylorseer:lite is its lite mode)"
                                                                      if kind == "taylorseer" else ""))
    try:
        return StepCache(kind=kind, threshold=float(threshold))
    except ValueError:
        raise ValueError(f"cache threshold {threshold!r} is not a number") from None


class Control(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One ControlNet applied to a request: the pipelines' `controlnet_conditioning_scale`,
    `control_guidance_start` and `control_guidance_end` for it. Several in one request are
    diffusers' multi-ControlNet (their residuals summed in the given order)."""

    name: str  # a ControlNet the engine serves (`--controlnet NAME=PATH`; GET /v1/models lists them)
    image: Annotated[bytes, msgspec.Meta(description=(
        "ControlNet: the control image (edges, depth, pose...), PNG, JPEG or WebP; resized to the output size"))]
    scale: float = 1.0  # its residuals' scale (the pipeline's controlnet_conditioning_scale)
    start: float = 0.0  # the share of the steps where it starts to apply (control_guidance_start)
    end: float = 1.0  # ... and where it stops (control_guidance_end)


class GenerateParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One generation request, as the user writes it. Validated by the engine against
    the loaded model (prompts, sizes, samplers, step limit).

    `prompt` is the text for text-conditioned models and the class name for
    class-conditional ones; `negative_prompt` conditions the unconditional branch of
    classifier-free guidance ("" as the pipelines' default). Sampler `default` runs the
    model folder's own scheduler, as its pipeline would."""

    prompt: str
    negative_prompt: str | None = None  # None: not given (SDXL then zeroes the branch); "" the empty prompt
    steps: int = 20
    sampler: str = "default"
    guidance: float = 3.0  # the pipeline's `guidance_scale`, whatever that pipeline does with it
    seed: int = 0
    output: str = "png"
    height: int | None = None  # None: the model's native size
    width: int | None = None
    true_cfg: float = 1.0  # FLUX: the pipeline's `true_cfg_scale` (two rows with the negative prompt)
    # SDXL micro-conditioning, (height, width) / (top, left) in pixels; None: the pipeline's defaults
    original_size: tuple[int, int] | None = None
    crops_coords_top_left: tuple[int, int] | None = None
    target_size: tuple[int, int] | None = None
    loras: dict[str, float] = {}  # adapter name → scale (`--lora-dir`)
    # image inputs (img2img, inpainting). Every bytes field travels as its own frame beside
    # Submit, never inside the message; its description is what the HTTP upload form shows
    image: Annotated[bytes, msgspec.Meta(description=(
        "img2img, inpainting: the image to start from, PNG, JPEG or WebP (its size is the output's "
        "unless height and width are given)"))] | None = None
    mask: Annotated[bytes, msgspec.Meta(description=(
        "inpainting: PNG, JPEG or WebP of the image's size, white = repaint"))] | None = None
    strength: float | None = None  # 0 < s ≤ 1; None: the model's image pipeline's own default
    # scheduling: a higher priority is admitted first and may park running requests of a
    # lower one at a step boundary; a deadline (seconds after arrival) orders a priority by slack
    priority: int = 0
    deadline_s: float | None = None
    # skipping work between steps (None: the server's `--cache` default)
    cache: StepCache | None = None
    # ControlNets (each control image travels as its own frame, `controls.N.image`)
    controls: tuple[Control, ...] = ()
    guess_mode: bool = False  # SD/SDXL ControlNet's guess mode: the ControlNets see only the prompt's row
    # IP-Adapter (`--ip-adapter`): an image as a prompt, at a scale
    ip_image: Annotated[bytes, msgspec.Meta(description=(
        "IP-Adapter: an image as a prompt, PNG, JPEG or WebP (the engine's --ip-adapter)"))] | None = None
    ip_scale: float = 1.0  # its scale (the pipeline's set_ip_adapter_scale)


class Timings(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per-request service record. Seconds, and denoiser rows."""

    queue_s: float = 0.0  # arrival → admitted into a slot
    denoise_s: float = 0.0  # admitted → last denoise step's fence done
    decode_wait_s: float = 0.0  # denoise done → a decoder starts on it
    decode_s: float = 0.0  # decode + post-processing
    total_s: float = 0.0  # arrival → usable output
    evals: int = 0  # useful denoiser rows computed for this request
    padded_evals: int = 0  # rows computed in its batches that served no one
    encode_s: float = 0.0  # its prompts' text-encoder pass (0 when the embedding cache had them)
    image_encode_s: float = 0.0  # its image inputs' VAE encoder pass at admission (0 without an image)
    parked_s: float = 0.0  # time spent parked (preempted by higher-priority requests)
    preemptions: int = 0  # times it was parked
    cached_steps: float = 0.0  # steps its step cache skipped (a true-CFG request's two branches count a half each)


class Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True,
              forbid_unknown_fields=True):
    """Base of every wire message; the tag is the first array element."""


# --------------------------------------------------------------------- client → engine


class Hello(Message, tag="hello"):
    """First message of a session. The engine answers Welcome, or Rejected(field="version")."""

    version: int
    pid: int = 0  # for the engine's logs only
    name: str = ""
    token: str = ""  # shared secret, when the engine was started with --auth-token-file


class Submit(Message, tag="submit"):
    request_id: RequestId  # chosen by the client, unique among its unfinished requests
    params: GenerateParams
    progress: bool = True  # send a Progress message after every denoising step
    partial_images: PartialImages = 0  # previews (PartialImage) of the clean-image estimate at evenly spaced steps
    # the paths of the frame fields (`frame_paths`) whose bytes follow the body as their own
    # frames, in frame order; those fields are emptied in the body
    inputs: tuple[str, ...] = ()


class Cancel(Message, tag="cancel"):
    """Idempotent; unknown or finished ids are ignored."""

    request_id: RequestId


class Delivered(Message, tag="delivered"):
    """The client has received this request's output (its Completed, or the final
    message of a request whose partial images it was sent): those bytes leave the
    client's output budget. A client that stops reading stops sending these, and
    the engine refuses to reuse the request id until it does."""

    request_id: RequestId


class Stats(Message, tag="stats"):
    token: int = 0  # echoed in StatsReply


class Health(Message, tag="health"):
    """A liveness probe, answered by the engine's IO thread with HealthReply."""

    token: int = 0  # echoed in HealthReply


class Goodbye(Message, tag="goodbye"):
    """The client is closing: the engine cancels its unfinished requests at once."""


class Heartbeat(Message, tag="heartbeat"):
    """Liveness, in both directions."""


# --------------------------------------------------------------------- engine → client


class Welcome(Message, tag="welcome"):
    version: int
    engine_pid: int
    heartbeat_interval_s: float
    peer_timeout_s: float  # silence after which either side declares the other dead
    output_budget_bytes: int  # this client's cap on undelivered output bytes
    model: str = ""
    prompts: list[str] = []  # the prompts a class-conditional model knows; [] for free text
    native_size: int = 0
    pipeline: str = ""  # the served folder's pipeline class
    max_message_bytes: int = MAX_MESSAGE_BYTES  # larger client messages are Rejected naming this limit
    max_input_bytes: int = MAX_INPUT_BYTES  # each input frame at most this many bytes (Submit.inputs)
    controlnets: list[str] = []  # the ControlNets served beside the model (`--controlnet`), by name


class Accepted(Message, tag="accepted"):
    request_id: str
    queue_depth: int = 0  # requests waiting for a slot, this one included


class Progress(Message, tag="progress"):
    """After `step` of `total` denoising steps. Lossy: a slow reader may see steps skipped."""

    request_id: str
    step: int
    total: int


class ProgressBatch(Message, tag="progress_batch"):
    """Progress of several of one client's requests after one denoising step, in one
    message (the engine coalesces them per client per step): `items` are
    (request_id, step, total). The client delivers each as a `Progress`."""

    items: list[tuple[str, int, int]]


class PartialImage(Message, tag="partial_image", dict=True, gc=True):
    """A preview: the clean-image estimate x0 after `step` of `total` steps, decoded. The
    PNG bytes follow in one extra frame (the client attaches them as `image`). All of a
    request's partial images arrive before its Completed."""

    request_id: str
    index: int  # 0-based among the request's partial images
    step: int
    total: int


class Completed(Message, tag="completed", dict=True, gc=True):
    """The result. `output` is not part of the body: the client attaches it from the
    extra frame — PNG bytes ("png"), a read-only numpy uint8 H×W×3 array ("uint8"),
    or a read-only numpy float32 C×H×W array of the final latents ("latent")."""

    request_id: str
    timings: Timings
    output_kind: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name of the extra frame ("uint8" for PNG bytes)


class Canceled(Message, tag="canceled"):
    """Terminal; `timings` holds the work done before the cancel took effect."""

    request_id: str
    timings: Timings = msgspec.field(default_factory=Timings)


class Rejected(Message, tag="rejected"):
    """Terminal: the request never entered the engine (bad input, full queue, budget).
    `field` names the offending field where there is one; retry only if
    `retry_after_s` > 0."""

    request_id: str
    reason: str
    field: str | None = None
    retry_after_s: float = 0.0


class Failed(Message, tag="failed"):
    """Terminal: the engine accepted the request but could not finish it."""

    request_id: str
    error: str


class EngineDead(Message, tag="engine_dead"):
    """The engine is going away (shutdown), or has written this client off; every
    unfinished request of the client is lost."""

    reason: str


class StatsReply(Message, tag="stats_reply"):
    token: int
    stats: dict[str, Any]
    adapters: list[str] = []  # the LoRA adapters the engine serves now (`--lora-dir`), by name


class HealthReply(Message, tag="health_reply"):
    """`alive`: the busy loop beat within `stall_limit_s` (the engine's --step-timeout), or
    the step it runs has run less than that; `reason` says why not. `stats` is the busy
    loop's latest published snapshot, `stats_age_s` old (empty before the first)."""

    token: int
    alive: bool
    draining: bool
    reason: str = ""
    step_running_s: float = 0.0  # how long the step in progress has run; 0: none
    loop_silent_s: float = 0.0  # since the busy loop last beat
    stall_limit_s: float = 0.0
    stats: dict[str, Any] = {}
    stats_age_s: float = 0.0


ClientMessage = Union[Hello, Submit, Cancel, Delivered, Stats, Health, Goodbye, Heartbeat]
EngineMessage = Union[Welcome, Accepted, Progress, ProgressBatch, PartialImage, Completed, Canceled, Rejected,
                      Failed, EngineDead, StatsReply, HealthReply, Heartbeat]
TERMINAL = (Completed, Canceled, Rejected, Failed)


def client_decoder() -> msgspec.msgpack.Decoder:
    """What the engine decodes: only client → engine messages."""
    return msgspec.msgpack.Decoder(ClientMessage)


def engine_decoder() -> msgspec.msgpack.Decoder:
    """What a client decodes: only engine → client messages."""
    return msgspec.msgpack.Decoder(EngineMessage)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


# --------------------------------------------------------------------- decode errors

_TAG_TO_TYPE = {t.__struct_config__.tag: t for t in ClientMessage.__args__ + EngineMessage.__args__}
_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_NAMED = re.compile(r"field `(?P<name>[^`]+)`")


def describe_decode_error(body: bytes, error: Exception) -> tuple[str | None, str | None]:
    """(request_id, field) for a frame that failed to decode, as far as they can be
    recovered: msgspec reports array positions (`$[2].steps`), which are mapped back
    to field names through the message's tag. Parameter fields are named as in
    GenerateParams ("steps"), message fields by their own name ("request_id")."""
    try:
        raw = msgspec.msgpack.decode(body)
    except Exception:
        return None, None
    if not isinstance(raw, list) or not raw:
        return None, "type"
    request_id = raw[1] if len(raw) > 1 and isinstance(raw[1], str) and 0 < len(raw[1]) <= MAX_REQUEST_ID_LEN \
        else None
    message_type = _TAG_TO_TYPE.get(raw[0]) if isinstance(raw[0], str) else None
    if message_type is None or "request_id" not in message_type.__struct_fields__:
        request_id = None
    text = str(error)
    match = _PATH.search(text)
    named = _NAMED.search(text)
    fields = message_type.__struct_fields__ if message_type else ()
    if match is None:  # an error about the whole array, e.g. a missing element
        short = re.search(r"at least length \d+, got (\d+)", text)
        if short and 0 < int(short.group(1)) <= len(fields):
            return request_id, fields[int(short.group(1)) - 1]
        return request_id, named.group("name") if named else None
    path = match.group("path")
    index = re.match(r"\[(\d+)\]", path)
    if index is None:
        return request_id, None
    position = int(index.group(1))
    rest = path[index.end():]
    if position == 0:
        return request_id, "type"
    if position - 1 >= len(fields):
        return request_id, None
    name = fields[position - 1]
    if name == "params":  # name the parameter the user wrote, not the envelope
        sub = re.match(r"\.(\w+)", rest)
        if sub:
            return request_id, sub.group(1)
        if named:
            return request_id, named.group("name")
    return request_id, name


def output_nbytes(kind: str, height: int, width: int, latent_shape: tuple[int, ...]) -> int:
    """Upper bound of the output frame's size, reserved against a client's budget
    before the request is admitted."""
    if kind == "latent":
        return 4 * math.prod(latent_shape)
    raw = height * width * 3
    if kind == "png":  # stored deflate blocks + one filter byte per row + chunk headers
        return raw + height + raw // 1000 + 1024
    return raw


# --------------------------------------------------------------------- frame fields

@functools.lru_cache(maxsize=None)
def _frame_field_types(struct_type) -> dict[str, tuple[bool, object]]:
    """name → (optional, nested struct type or None) for every field of `struct_type` that
    carries bytes: typed bytes itself, or a struct (or a tuple of structs) that has some."""
    import msgspec.inspect as mi

    found = {}
    for field in mi.type_info(struct_type).fields:
        kinds = field.type.types if isinstance(field.type, mi.UnionType) else (field.type,)
        kinds = [k.type if isinstance(k, mi.Metadata) else k for k in kinds]
        optional = any(isinstance(k, mi.NoneType) for k in kinds)
        for kind in kinds:
            if isinstance(kind, mi.BytesType):
                found[field.name] = (optional, None)
            item = kind.item_type if isinstance(kind, (mi.VarTupleType, mi.ListType)) else kind
            if isinstance(item, mi.StructType) and _frame_field_types(item.cls):
                found[field.name] = (optional, item.cls)
    return found


#: The fields of `GenerateParams` whose bytes travel as frames (top level), in declaration order.
FRAME_FIELDS = tuple(_frame_field_types(GenerateParams))
#: Those that are bytes themselves (one file each in an upload form; `controls` holds its images nested).
FILE_FIELDS = tuple(name for name, (_, nested) in _frame_field_types(GenerateParams).items() if nested is None)


def frame_field_descriptions() -> dict[str, str]:
    """field → its declared description, for every top-level bytes field (upload forms' files)."""
    import msgspec.inspect as mi

    described = {}
    for field in mi.type_info(GenerateParams).fields:
        if field.name in FILE_FIELDS:
            kinds = field.type.types if isinstance(field.type, mi.UnionType) else (field.type,)
            meta = next((k for k in kinds if isinstance(k, mi.Metadata)), None)
            described[field.name] = ((meta.extra_json_schema or {}).get("description", "") if meta else "")
    return described


def frame_paths(params) -> list[tuple[str, Any]]:
    """(path, value) of every frame field holding a value, in declaration order: `image`,
    `mask`, and nested ones as `field.index.name`."""
    found = []

    def walk(struct, prefix: str) -> None:
        for name, (_, nested) in _frame_field_types(type(struct)).items():
            value = getattr(struct, name)
            if nested is None:
                if value is not None and not (isinstance(value, (bytes, bytearray, memoryview))
                                              and prefix and memoryview(value).nbytes == 0):
                    found.append((prefix + name, value))
            elif isinstance(value, (tuple, list)):
                for index, item in enumerate(value):
                    walk(item, f"{prefix}{name}.{index}.")
            elif value is not None:
                walk(value, f"{prefix}{name}.")

    walk(params, "")
    return found


def _replace_path(struct, parts: list[str], value):
    name, rest = parts[0], parts[1:]
    if not rest:
        return msgspec.structs.replace(struct, **{name: value})
    current = getattr(struct, name)
    if isinstance(current, (tuple, list)):
        index = int(rest[0])
        items = list(current)
        items[index] = _replace_path(items[index], rest[1:], value)
        return msgspec.structs.replace(struct, **{name: type(current)(items)})
    return msgspec.structs.replace(struct, **{name: _replace_path(current, rest, value)})


def split_frames(params) -> tuple[Any, list[str], list[Any]]:
    """(params with every frame field emptied, their paths, their bytes in the same order).
    An optional field is emptied to None, a required nested one to b""."""
    paths, frames = [], []
    for path, value in frame_paths(params):
        paths.append(path)
        frames.append(value)
        params = _replace_path(params, path.split("."), None if "." not in path else b"")
    return params, paths, frames


def path_problem(params, path: str) -> str | None:
    """Why `path` cannot name a frame of `params` (unknown, or already holding bytes), or None."""
    parts = path.split(".")
    struct = params
    while True:
        fields = _frame_field_types(type(struct))
        name = parts[0]
        if name not in fields:
            return f"unknown input {path!r} in Submit.inputs; frame fields: {', '.join(FRAME_FIELDS)}"
        value = getattr(struct, name)
        nested = fields[name][1]
        if nested is None:
            if len(parts) != 1:
                return f"unknown input {path!r} in Submit.inputs"
            if value is not None and not (isinstance(value, (bytes, bytearray)) and len(value) == 0):
                return "given both in the message and as a frame (Submit.inputs)"
            return None
        if isinstance(value, (tuple, list)):
            if len(parts) < 3 or not parts[1].isdigit() or int(parts[1]) >= len(value):
                return f"unknown input {path!r} in Submit.inputs"
            struct, parts = value[int(parts[1])], parts[2:]
        elif value is None or len(parts) < 2:
            return f"unknown input {path!r} in Submit.inputs"
        else:
            struct, parts = value, parts[1:]


def attach_frames(params, paths, frames):
    """`params` with each frame set at its path (the inverse of `split_frames`); check each
    path with `path_problem` first."""
    for path, frame in zip(paths, frames):
        params = _replace_path(params, path.split("."), frame)
    return params
