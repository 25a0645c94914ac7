"""Wire protocol: round-trips, validation with field names, addresses, and a fuzzed
engine that answers every malformed frame with Rejected and keeps serving."""
from __future__ import annotations

import math
import os
import socket

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from proc_helpers import RawPeer, encode_raw, fake_engine, socket_dir

from engine.serve import transport
from engine.protocol import (
    PROTOCOL_VERSION, Accepted, Cancel, Canceled, Completed, Delivered, EngineDead, Failed, GenerateParams,
    Goodbye, Heartbeat, Hello, Progress, ProgressBatch, Rejected, Stats, StatsReply, Submit, Timings, Welcome,
    client_decoder, describe_decode_error, encoder, engine_decoder, output_nbytes,
)

TIMINGS = Timings(queue_s=0.5, denoise_s=1.25, decode_wait_s=0.0625, decode_s=0.125, total_s=2.0, evals=40,
                  padded_evals=3)
CLIENT_MESSAGES = [
    Hello(PROTOCOL_VERSION, 1234, "test"), Hello(PROTOCOL_VERSION, 1, "", "token-with-ünïcode"),
    Submit("r1", GenerateParams("a red circle", steps=7, sampler="ddim", guidance=1.5, seed=3, output="latent",
                                height=64, width=32)),
    Submit("r2", GenerateParams("a blue cross"), progress=False),
    Cancel("r1"), Delivered("r1"), Stats(9), Goodbye(), Heartbeat(),
]
ENGINE_MESSAGES = [
    Welcome(PROTOCOL_VERSION, 42, 0.5, 3.0, 1 << 20, "shapes", ["a red circle", ""], 32),
    Welcome(PROTOCOL_VERSION, 42, 0.5, 3.0, 1 << 20, max_message_bytes=1 << 16),
    Accepted("r1", 2), Progress("r1", 3, 20), ProgressBatch([("r1", 3, 20), ("r2", 1, 4)]), Completed("r1", TIMINGS, "uint8", (32, 32, 3), "uint8"),
    Canceled("r1", TIMINGS), Canceled("r2"), Rejected("r1", "bad", "steps", 1.5), Rejected("r1", "bad"),
    Failed("r1", "boom"), EngineDead("shutdown"), StatsReply(9, {"slots": 16, "ratio": 0.5, "name": "x"}),
    Heartbeat(),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda m: type(m).__name__)
def test_client_messages_round_trip(msg):
    assert client_decoder().decode(encoder().encode(msg)) == msg


@pytest.mark.timeout(10)
@pytest.mark.parametrize("msg", ENGINE_MESSAGES, ids=lambda m: type(m).__name__)
def test_engine_messages_round_trip(msg):
    assert engine_decoder().decode(encoder().encode(msg)) == msg


@pytest.mark.timeout(10)
def test_request_id_is_read_from_the_head_of_an_oversized_frame():
    from engine.serve.frames import peek_request_id

    huge = encoder().encode(Submit("r-big", GenerateParams("a red circle " + "x" * (1 << 20))))
    assert peek_request_id(huge) == "r-big"
    assert peek_request_id(encoder().encode(Cancel("c" * 128))) == "c" * 128
    for body in (b"", b"\xff" * 8, encoder().encode(Heartbeat()), encoder().encode(Stats(3)),
                 encode_raw(["submit", 5]), encode_raw(["submit", ""]), huge[:6], encode_raw({"a": 1})):
        assert peek_request_id(body) == ""


@pytest.mark.timeout(10)
def test_bodies_are_tagged_arrays_and_outputs_stay_out_of_them():
    body = encoder().encode(Submit("r1", GenerateParams("a red circle", steps=4)))
    assert msgspec.msgpack.decode(body) == ["submit", "r1", {"prompt": "a red circle", "steps": 4}, True, 0, []]
    done = Completed("r1", TIMINGS, "latent", (4, 8, 8), "float32")
    done.output = np.full((4, 8, 8), 7.0, np.float32)  # attached client-side, never encoded
    assert len(encoder().encode(done)) < 200
    assert not hasattr(engine_decoder().decode(encoder().encode(done)), "output")


@pytest.mark.timeout(10)
def test_directional_decoders_refuse_the_other_side():
    with pytest.raises(msgspec.ValidationError):
        client_decoder().decode(encoder().encode(Accepted("r1")))
    with pytest.raises(msgspec.ValidationError):
        engine_decoder().decode(encoder().encode(Submit("r1", GenerateParams("x"))))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("raw, request_id, field", [
    (["submit", "r1", {"prompt": "x", "steps": "20"}], "r1", "steps"),
    (["submit", "r1", {"prompt": "x", "steps": True}], "r1", "steps"),
    (["submit", "r1", {"prompt": "x", "guidance": "3"}], "r1", "guidance"),
    (["submit", "r1", {"prompt": "x", "colour": "red"}], "r1", "colour"),
    (["submit", "r1", {"steps": 3}], "r1", "prompt"),
    (["submit", "r1", "a red circle"], "r1", "params"),
    (["submit", "r1"], "r1", "params"),
    (["submit", 7, {"prompt": "x"}], None, "request_id"),
    (["submit", "", {"prompt": "x"}], None, "request_id"),
    (["submit", "x" * 200, {"prompt": "x"}], None, "request_id"),
    (["submit", "r1", {"prompt": "x"}, "yes"], "r1", "progress"),
    (["cancel"], None, "request_id"),
    (["hello", "one"], None, "version"),
    (["launch", "r1"], None, "type"),
    ([7, "r1"], None, "type"),
    ({"type": "submit"}, None, "type"),
    ("submit", None, "type"),
])
def test_decode_errors_name_the_field(raw, request_id, field):
    body = encode_raw(raw)
    with pytest.raises(msgspec.ValidationError) as info:
        client_decoder().decode(body)
    assert describe_decode_error(body, info.value) == (request_id, field)


@pytest.mark.timeout(10)
def test_undecodable_bytes_name_nothing():
    with pytest.raises(msgspec.DecodeError) as info:
        client_decoder().decode(b"\xc1\x00")
    assert describe_decode_error(b"\xc1\x00", info.value) == (None, None)


@pytest.mark.timeout(10)
def test_output_reservation_bounds_real_outputs():
    from engine.decode.stage import encode_png

    rng = np.random.default_rng(0)
    for size in (8, 32, 100):
        noise = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)  # incompressible: the worst case
        assert len(encode_png(noise)) <= output_nbytes("png", size, size, (4, size // 4, size // 4))
    assert output_nbytes("uint8", 32, 48, ()) == 32 * 48 * 3
    assert output_nbytes("latent", 32, 32, (4, 8, 8)) == 4 * 4 * 8 * 8


# ----------------------------------------------------------------------------- addresses


@pytest.mark.timeout(10)
@pytest.mark.parametrize("address, ok", [
    ("ipc:///tmp/x.sock", True), ("tcp://127.0.0.1:5555", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("tcp://127.0.0.2:5555", True), ("tcp://*:5555", False),
    ("tcp://0.0.0.0:5555", False), ("tcp://10.1.2.3:5555", False), ("udp://127.0.0.1:5", False),
    ("/tmp/x.sock", False),
])
def test_bind_addresses_are_local_unless_allowed(address, ok):
    if ok:
        transport.check_bind_address(address)
    else:
        with pytest.raises(ValueError):
            transport.check_bind_address(address)
    if address.startswith("tcp://"):
        transport.check_bind_address(address, allow_remote=True)


@pytest.mark.timeout(10)
def test_default_address_discovery_and_stale_sweep(monkeypatch):
    with socket_dir() as directory:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(directory))
        monkeypatch.delenv("DIFFSLOT_ADDRESS", raising=False)
        assert transport.default_address(123) == f"ipc://{directory}/diffslot-123.sock"
        with pytest.raises(ConnectionError, match="no running"):
            transport.discover_address()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a live engine's socket
        listener.bind(str(directory / f"diffslot-{os.getpid()}.sock"))
        listener.listen()
        dead = directory / "diffslot-999999999.sock"  # left by a killed engine
        dead.touch()
        try:
            assert transport.discover_address() == f"ipc://{directory}/diffslot-{os.getpid()}.sock"
            assert transport.sweep_stale_sockets(directory) == [dead]
            assert (directory / f"diffslot-{os.getpid()}.sock").exists()
            assert transport.ipc_in_use(directory / f"diffslot-{os.getpid()}.sock")
        finally:
            listener.close()
        monkeypatch.setenv("DIFFSLOT_ADDRESS", "tcp://127.0.0.1:1")
        assert transport.discover_address() == "tcp://127.0.0.1:1"


# ----------------------------------------------------------------------------- engine side


@pytest.fixture(scope="module")
def engine():
    with fake_engine("--peer-timeout", "60") as e:
        yield e


@pytest.fixture(scope="module")
def peer(engine):
    p = RawPeer(engine.address)
    yield p
    p.close()


def roundtrip(peer: RawPeer, token: int):
    """Everything the engine says until it answers Stats(token): proves it is alive and
    has processed all frames sent before."""
    peer.send(Stats(token))
    seen = []
    while True:
        msg = peer.recv(10)
        if isinstance(msg, StatsReply) and msg.token == token:
            return seen, msg.stats
        seen.append(msg)


def submit_raw(peer: RawPeer, raw) -> Rejected | Accepted:
    peer.send_frames([encode_raw(raw)] if not isinstance(raw, bytes) else [raw])
    while True:
        msg = peer.recv(10)
        if isinstance(msg, (Rejected, Accepted)):
            return msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("params, field", [
    ({"prompt": "a red circle", "steps": "20"}, "steps"),
    ({"prompt": "a red circle", "stepz": 20}, "stepz"),
    ({"steps": 20}, "prompt"),
    ({"prompt": "purple blob"}, "prompt"),
    ({"prompt": "a red circle", "steps": 0}, "steps"),
    ({"prompt": "a red circle", "steps": 10**9}, "steps"),
    ({"prompt": "a red circle", "steps": 2**70}, None),  # beyond msgpack ints: malformed
    ({"prompt": "a red circle", "sampler": "heun"}, "sampler"),
    ({"prompt": "a red circle", "guidance": math.nan}, "guidance"),
    ({"prompt": "a red circle", "guidance": math.inf}, "guidance"),
    ({"prompt": "a red circle", "guidance": -1.0}, "guidance"),
    ({"prompt": "a red circle", "height": 33}, "height"),
    ({"prompt": "a red circle", "width": 1 << 20}, "width"),
    ({"prompt": "a red circle", "output": "jpeg"}, "output"),
    ({"prompt": "a red circle", "seed": -1}, "seed"),
])
def test_bad_params_are_rejected_naming_the_field(peer, params, field):
    if field is None:
        with pytest.raises(OverflowError):
            encode_raw(params)
        return
    reply = submit_raw(peer, ["submit", f"bad-{field}", params])
    assert isinstance(reply, Rejected), reply
    assert reply.field == field, reply
    assert reply.request_id == f"bad-{field}"
    assert reply.reason


@pytest.mark.timeout(60)
def test_malformed_frames_are_rejected(engine, peer):
    cases = [
        b"\xc1",  # not msgpack
        b"\x92\xa6submit\xa2\xff\xfe",  # invalid UTF-8 in a string: msgspec raises UnicodeDecodeError
        b"",
        encode_raw(["submit"]),
        encode_raw(["nonsense", 1, 2, 3]),
        encode_raw({"a": 1}),
        b"\x00" * (128 * 1024),  # too large
    ]
    for body in cases:
        reply = submit_raw(peer, body)
        assert isinstance(reply, Rejected) and reply.reason, (body[:20], reply)
    peer.send_frames([encode_raw(["heartbeat"]), b"extra"])  # two frames
    reply = peer.recv(5)
    assert isinstance(reply, Rejected) and "frame" in reply.reason
    # Duplicate ids are refused while the first is unfinished.
    first = submit_raw(peer, encode_raw(["submit", "dup", {"prompt": "a red circle", "steps": 1000}]))
    second = submit_raw(peer, encode_raw(["submit", "dup", {"prompt": "a red circle"}]))
    assert isinstance(first, Accepted)
    assert isinstance(second, Rejected) and second.field == "request_id"
    peer.send(Cancel("dup"))
    seen, _ = roundtrip(peer, 1)
    # Still serving.
    assert isinstance(submit_raw(peer, encode_raw(["submit", "ok", {"prompt": "a red circle", "steps": 2}])),
                      Accepted)


@pytest.mark.timeout(30)
def test_handshake_is_required_and_versioned(engine):
    stranger = RawPeer(engine.address, hello=False)
    try:
        stranger.send(Submit("r1", GenerateParams("a red circle")))
        reply = stranger.recv(5)
        assert isinstance(reply, Rejected) and reply.field == "version" and reply.request_id == "r1"
        stranger.send(Hello(PROTOCOL_VERSION + 1))
        reply = stranger.recv(5)
        assert isinstance(reply, Rejected) and reply.field == "version"
        stranger.send(Hello(PROTOCOL_VERSION))
        assert isinstance(stranger.recv(5), Welcome)
    finally:
        stranger.close()


VALID = ["submit", "fuzz", {"prompt": "a red circle", "steps": 3, "sampler": "euler", "guidance": 2.0,
                            "seed": 1, "output": "uint8"}, True]
msgpack_ints = st.integers(-(2**63), 2**64 - 1)
values = st.one_of(
    st.none(), st.booleans(), msgpack_ints, st.floats(allow_nan=True),
    st.text(max_size=20), st.binary(max_size=20), st.lists(msgpack_ints, max_size=3),
    st.dictionaries(st.text(max_size=5), msgpack_ints, max_size=2),
)


@st.composite
def mutated_frames(draw):
    kind = draw(st.sampled_from(["random", "element", "param", "drop_param", "extra_param", "truncate", "flip"]))
    if kind == "random":
        return draw(st.binary(max_size=64))
    raw = [VALID[0], VALID[1], dict(VALID[2]), VALID[3]]
    if kind == "element":
        raw[draw(st.integers(0, 3))] = draw(values)
    elif kind == "param":
        raw[2][draw(st.sampled_from(sorted(raw[2])))] = draw(values)
    elif kind == "drop_param":
        del raw[2][draw(st.sampled_from(sorted(raw[2])))]
    elif kind == "extra_param":
        raw[2][draw(st.text(min_size=1, max_size=8))] = draw(values)
    body = msgspec.msgpack.encode(raw)
    if kind == "truncate":
        body = body[:draw(st.integers(0, len(body) - 1))]
    elif kind == "flip":
        position = draw(st.integers(0, len(body) - 1))
        body = body[:position] + bytes([draw(st.integers(0, 255))]) + body[position + 1:]
    return body


@pytest.mark.timeout(300)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=mutated_frames())
def test_fuzzed_frames_never_hurt_the_engine(peer, body):
    try:  # frames that happen to be session control would end our session: not what is fuzzed
        decoded = client_decoder().decode(body)
        assume(not isinstance(decoded, (Hello, Goodbye, Stats)))
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):  # bad UTF-8 raises the latter
        pass
    peer.send_frames([body])
    seen, stats = roundtrip(peer, 7)
    for msg in seen:
        assert isinstance(msg, (Rejected, Accepted, Progress, Completed, Canceled, Failed)), msg
        if isinstance(msg, Rejected):
            assert msg.reason
    assert stats["pid"]
    # A valid request is still served after whatever came before.
    peer.send_frames([encode_raw(["submit", "probe", {"prompt": "a blue cross", "steps": 2, "output": "latent"}])])
    while not isinstance(msg := peer.recv(10), (Completed, Rejected, Failed)) or msg.request_id != "probe":
        pass
    assert isinstance(msg, Completed), msg
    assert msg.frames[0] and len(msg.frames[0]) == 4 * 4 * 8 * 8
    peer.send(Delivered("probe"))
    peer.send(Cancel("fuzz"))  # a valid mutation may still run: do not let it pile up
