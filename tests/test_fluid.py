"""R12: the fluid queue model, its CLI, its JSON API and --from-run."""
from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.request
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.instrument import LIMITS, FluidQueue, Prediction, fmt, main, make_server, parse_run

pytestmark = pytest.mark.timeout(60)

LIMIT_PHRASES = ("no batch slots", "solver coordinates", "cancellation events",
                 "GPU completion", "decode memory")


# --------------------------------------------------------------------------------------
# the two R12 scenarios, exactly
# --------------------------------------------------------------------------------------
def test_scenario_growing_backlog():
    q = FluidQueue()
    q.reset()
    assert (q.t, q.backlog) == (0, 4)
    q.set_rates(4, 3)
    assert q.predict(2) == Prediction(backlog=6, drain_time=None)
    steps = [q.step() for _ in range(4)]
    assert steps == [(0.5, 4.5), (1, 5), (1.5, 5.5), (2, 6)]
    assert steps[-1] == (2.0, 6.0)
    assert all(type(v) is float for s in steps for v in s)
    assert (q.t_exact, q.backlog_exact) == (Fraction(2), Fraction(6))


def test_scenario_draining_backlog():
    q = FluidQueue()
    q.reset()
    q.set_rates(2, 3)
    p = q.predict(4)
    assert p.drain_time == 4 and p.backlog == 0
    assert q.predict_exact(4) == (Fraction(0), Fraction(4))
    steps = [q.step() for _ in range(8)]
    assert steps[-1] == (4.0, 0.0)
    assert steps == [(k / 2, 4 - k / 2) for k in range(1, 9)]


# --------------------------------------------------------------------------------------
# clamping, drain time, rate changes, reset
# --------------------------------------------------------------------------------------
def test_backlog_never_below_zero():
    q = FluidQueue(arrival=2, service=3)
    for _ in range(20):
        t, b = q.step()
        assert b >= 0
    assert (t, b) == (10.0, 0.0)
    assert q.predict(1000) == (0, 4)  # drained at t = 4, stays empty
    # arrivals outpacing service again: the backlog grows from 0, not from a negative value
    q.set_rates(4, 3)
    assert q.step() == (10.5, 0.5)
    assert q.predict(12) == (2, None)


def test_equal_rates_hold_the_backlog():
    q = FluidQueue(arrival=3, service=3)
    assert q.predict(1e6) == (4, None)
    assert [q.step() for _ in range(3)][-1] == (1.5, 4)
    empty = FluidQueue(arrival=3, service=3, initial_backlog=0)
    assert empty.predict(5) == (0, 0)  # already empty at t = 0


def test_drain_time_edge_cases():
    assert FluidQueue(0, 0).predict(7) == (4, None)  # nothing moves
    assert FluidQueue(0, 1).predict(0) == (4, 4)
    assert FluidQueue(0, 8).predict(0.5) == (0, 0.5)
    assert FluidQueue(5, 1, initial_backlog=0).predict(1) == (4, None)
    assert FluidQueue(1, 5, initial_backlog=0).predict(1) == (0, 0)
    # drain time is absolute: rates changed at t = 1 (backlog 5) drain 5 / 2 later
    q = FluidQueue(4, 3)
    q.step(), q.step()
    q.set_rates(1, 3)
    assert q.predict(1) == (5, 3.5)
    assert q.predict(3.5) == (0, 3.5)


def test_predict_before_the_rates_took_effect_is_an_error():
    q = FluidQueue(4, 3)
    q.step()
    q.set_rates(1, 3)  # anchor at t = 0.5
    with pytest.raises(ValueError, match="t must be >= 0.5"):
        q.predict(0)
    with pytest.raises(ValueError, match=r"\bt\b"):
        FluidQueue().predict(-1)
    with pytest.raises(ValueError, match="NaN"):
        FluidQueue().predict(float("nan"))


def test_same_rates_do_not_move_the_anchor():
    q = FluidQueue(4, 3)
    q.step()
    q.set_rates(4, 3)
    assert q.anchor_t == 0
    assert q.predict(0) == (4, None)


def test_reset_keeps_rates_and_returns_to_t0_backlog4():
    q = FluidQueue()
    q.set_rates(2, 3)
    for _ in range(5):
        q.step()
    q.reset()
    assert (q.t, q.backlog, q.steps, q.anchor_t) == (0, 4, 0, 0)
    assert (q.arrival, q.service) == (2, 3)
    assert q.predict(4) == (0, 4)


@pytest.mark.parametrize("which", ["arrival", "service"])
@pytest.mark.parametrize(
    "bad, message",
    [(-1, "must be >= 0"), (-0.5, "must be >= 0"), (float("nan"), "NaN"), ("nan", "NaN"),
     (float("inf"), "finite"), (float("-inf"), "finite"), ("inf", "finite"),
     ("abc", "must be a number"), ("", "must be a number"), (None, "must be a number"),
     (True, "must be a number")],
)
def test_bad_rates_raise_naming_the_rate(which, bad, message):
    q = FluidQueue(1, 2)
    q.step()
    rates = {"arrival": 1, "service": 2, which: bad}
    with pytest.raises(ValueError, match=rf"{which} rate .*{message}|{which} rate {message}"):
        q.set_rates(rates["arrival"], rates["service"])
    # nothing changed
    assert (q.arrival, q.service, q.t, q.anchor_t) == (1, 2, 0.5, 0)
    with pytest.raises(ValueError, match=f"{which} rate"):
        FluidQueue(**{which: bad})


def test_bad_initial_backlog():
    with pytest.raises(ValueError, match="initial backlog"):
        FluidQueue(initial_backlog=-1)


# --------------------------------------------------------------------------------------
# exactness
# --------------------------------------------------------------------------------------
def test_decimal_rates_are_exact():
    q = FluidQueue("0.1", "0.3")
    assert q.predict_exact(0)[1] == 20  # 4 / 0.2, exactly
    for _ in range(40):
        t, b = q.step()
    assert (t, b) == (20.0, 0.0)
    q = FluidQueue("0.1", "0")
    for _ in range(30):
        t, b = q.step()
    assert (t, b) == (15.0, 5.5)
    # the float a naive accumulation would give differs; ours is the closed form
    acc = 4.0
    for _ in range(30):
        acc += 0.1 * 0.5
    assert acc != 5.5


def test_many_steps_have_exact_times():
    q = FluidQueue(3, 3)
    for _ in range(100_001):
        t, _ = q.step()
    assert t == 50_000.5 and q.t_exact == Fraction(100_001, 2)


@settings(max_examples=200, deadline=None)
@given(
    lam=st.fractions(min_value=0, max_value=50, max_denominator=64),
    mu=st.fractions(min_value=0, max_value=50, max_denominator=64),
    n=st.integers(min_value=0, max_value=60),
)
def test_steps_follow_the_closed_form(lam, mu, n):
    q = FluidQueue(lam, mu)
    out = [q.step() for _ in range(n)]
    for k, (t, b) in enumerate(out, start=1):
        exact = max(Fraction(0), 4 + (lam - mu) * Fraction(k, 2))
        assert t == k / 2 and b == float(exact) and b >= 0
    drain = q.drain_time_exact()
    if lam < mu:
        assert drain == Fraction(4) / (mu - lam)
        assert q.predict_exact(drain) == (0, drain)
    else:
        assert drain is None


def test_curve_breakpoints():
    q = FluidQueue(2, 3)
    assert q.curve(6) == [(0, 4), (4, 0), (6, 0)]
    assert FluidQueue(4, 3).curve(2) == [(0, 4), (2, 6)]


def test_fmt():
    assert [fmt(x) for x in (Fraction(6), Fraction(1, 2), 4.0, 0.1, Fraction(1, 3), None)] == \
        ["6", "0.5", "4", "0.1", "0.333333333333", "never"]


# --------------------------------------------------------------------------------------
# the CLI
# --------------------------------------------------------------------------------------
def test_cli_scenario_growing(capsys):
    assert main(["--arrival", "4", "--service", "3", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "reset: t = 0, backlog = 4" in out
    assert "predict t = 2: backlog = 6, drain time = never" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert steps == [
        "step 1: (t, backlog) = (0.5, 4.5)",
        "step 2: (t, backlog) = (1, 5)",
        "step 3: (t, backlog) = (1.5, 5.5)",
        "step 4: (t, backlog) = (2, 6)",
    ]
    assert all(p in out for p in LIMIT_PHRASES)


def test_cli_scenario_draining(capsys):
    assert main(["--arrival", "2", "--service", "3", "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "predict t = 4: backlog = 0, drain time = 4" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 8 and steps[-1] == "step 8: (t, backlog) = (4, 0)"


def test_cli_predict_t(capsys):
    assert main(["--arrival", "2", "--service", "3", "--steps", "0", "--predict-t", "10"]) == 0
    out = capsys.readouterr().out
    assert "predict t = 10: backlog = 0, drain time = 4" in out
    assert "step " not in out


def test_cli_help_states_the_limits(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert all(p in out for p in LIMIT_PHRASES)
    assert "--from-run" in out and "queue-instrument" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arrival", "-1", "--service", "3"], "arrival rate must be >= 0"),
        (["--arrival", "4", "--service", "nan"], "service rate must not be NaN"),
        (["--arrival", "4", "--service", "inf"], "service rate must be finite"),
        (["--arrival", "x", "--service", "3"], "arrival rate must be a number"),
        (["--arrival", "4"], "--arrival and --service are required"),
        (["--arrival", "4", "--service", "3", "--steps", "-1"], "--steps must be >= 0"),
        (["--serve", "--host", "0.0.0.0"], "non-loopback"),
        (["--serve", "--host", "example.org"], "non-loopback"),
    ],
)
def test_cli_errors(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err


# --------------------------------------------------------------------------------------
# --from-run
# --------------------------------------------------------------------------------------
RUN = {
    "engine": "continuous",  # extra keys are ignored
    "configs": {
        "continuous": {
            "arrival_rate": 2.0,
            "service_rate": 3.0,
            "backlog": [[0, 4], [1, 3], [2, 2.5], [3, 2.5], [4, 2]],
        },
        "late": {
            "arrival_rate": 4,
            "service_rate": 3,
            "initial_backlog": 4,
            "backlog": [[10, 5], [11, 5], [12, 6]],
        },
    },
}


@pytest.fixture
def run_file(tmp_path):
    p = tmp_path / "RESULTS.json"
    p.write_text(json.dumps(RUN))
    return p


def test_from_run_table(capsys, run_file):
    assert main(["--from-run", str(run_file)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    # continuous: fluid 4, 3, 2, 1, 0 at t = 0..4
    i = lines.index(next(line for line in lines if line.startswith("config continuous")))
    rows = [line.split()[:4] for line in lines[i + 2:i + 7]]
    assert rows == [["0", "4", "4", "0"], ["1", "3", "3", "0"], ["2", "2.5", "2", "0.5"],
                    ["3", "2.5", "1", "1.5"], ["4", "2", "0", "2"]]
    assert "fluid drain time 4 s" in lines[i]
    assert "max |deviation| = 2 requests at t = 4 s" in out
    assert "the fluid model stops holding at t = 3 s" in out
    # late: starts at t0 = 10 from the given initial backlog 4, not the first sample's 5
    assert "initial backlog 4 at t0 = 10 s" in out
    assert "max |deviation| = 1 requests at t = 10 s" in out
    assert "holds within 1 requests over the whole run" in out
    assert all(p in " ".join(out.split()) for p in LIMIT_PHRASES)


def test_from_run_tolerance(capsys, run_file):
    assert main(["--from-run", str(run_file), "--tolerance", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "the fluid model stops holding at t = 2 s" in out


def test_from_run_plot(capsys, run_file, tmp_path):
    png = tmp_path / "overlay.png"
    assert main(["--from-run", str(run_file), "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_instrument_plot(capsys, tmp_path):
    png = tmp_path / "instrument.png"
    assert main(["--arrival", "2", "--service", "3", "--steps", "8", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "doc, message",
    [
        ({}, '"configs"'),
        ({"configs": {}}, "empty"),
        ({"configs": {"a": {"arrival_rate": 1, "backlog": [[0, 1]]}}}, '"service_rate"'),
        ({"configs": {"a": {"arrival_rate": -1, "service_rate": 1, "backlog": [[0, 1]]}}},
         "arrival_rate must be >= 0"),
        ({"configs": {"a": {"arrival_rate": "x", "service_rate": 1, "backlog": [[0, 1]]}}},
         "arrival_rate must be a number"),
        ({"configs": {"a": {"arrival_rate": 1, "service_rate": 1, "backlog": []}}}, "non-empty"),
        ({"configs": {"a": {"arrival_rate": 1, "service_rate": 1, "backlog": [[1, 1], [0, 1]]}}},
         "must not decrease"),
        ({"configs": {"a": {"arrival_rate": 1, "service_rate": 1, "backlog": [[0, -1]]}}}, ">= 0"),
        ({"configs": {"a": {"arrival_rate": 1, "service_rate": 1, "backlog": [[0]]}}}, "pair"),
    ],
)
def test_from_run_rejects_bad_files(capsys, tmp_path, doc, message):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    assert main(["--from-run", str(p)]) == 2
    assert message in capsys.readouterr().err


def test_from_run_unreadable(capsys, tmp_path):
    assert main(["--from-run", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    p = tmp_path / "garbage.json"
    p.write_text("{not json")
    assert main(["--from-run", str(p)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_parse_run_nan_rate():
    with pytest.raises(ValueError, match="arrival_rate must not be NaN"):
        parse_run({"configs": {"a": {"arrival_rate": math.nan, "service_rate": 1,
                                     "backlog": [[0, 1]]}}})


# --------------------------------------------------------------------------------------
# the JSON API the page uses (in-process server; the browser test drives the page)
# --------------------------------------------------------------------------------------
@pytest.fixture
def api(run_file):
    server = make_server("127.0.0.1", 0, run=parse_run(json.loads(run_file.read_text())))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()

    def call(method, path, body=None, headers=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(server.url.rstrip("/") + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        yield call, server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_api_scenarios(api):
    call, _ = api
    _, s = call("POST", "/api/reset")
    assert (s["t"], s["backlog"], s["prediction"]) == (0, 4, None)
    assert call("POST", "/api/rates", {"arrival": "4", "service": "3"})[0] == 200
    _, s = call("GET", "/api/predict?t=2")
    assert s["prediction"] == {"t": 2, "backlog": 6, "drain_time": None}
    for _ in range(4):
        _, s = call("POST", "/api/step")
    assert (s["t"], s["backlog"]) == (2, 6)
    assert s["history"] == [[0, 4], [0.5, 4.5], [1, 5], [1.5, 5.5], [2, 6]]

    call("POST", "/api/reset")
    call("POST", "/api/rates", {"arrival": 2, "service": 3})
    _, s = call("GET", "/api/predict?t=4")
    assert s["prediction"] == {"t": 4, "backlog": 0, "drain_time": 4}
    for _ in range(8):
        _, s = call("POST", "/api/step")
    assert (s["t"], s["backlog"], s["drain_time"]) == (4, 0, 4)
    assert s["curve"][:2] == [[0, 4], [4, 0]]
    assert all(p in s["limits"] for p in LIMIT_PHRASES)


def test_api_errors_and_loopback_only(api):
    call, _ = api
    status, body = call("POST", "/api/rates", {"arrival": "-2", "service": "3"})
    assert status == 400 and "arrival rate" in body["error"]
    status, body = call("POST", "/api/rates", {"arrival": "1"})
    assert status == 400
    status, body = call("GET", "/api/predict")
    assert status == 400
    status, body = call("GET", "/api/predict?t=nan")
    assert status == 400 and "NaN" in body["error"]
    status, body = call("GET", "/api/state", headers={"Host": "attacker.example:80"})
    assert status == 403
    status, _ = call("GET", "/nope")
    assert status == 404


def test_api_page_and_run(api):
    _, server = api
    with urllib.request.urlopen(server.url, timeout=10) as r:
        page = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/html")
    for element_id in ("reset", "arrival", "service", "predict-t", "predict", "step", "t",
                       "backlog", "drain", "plot"):
        assert f'id="{element_id}"' in page
    assert " ".join(LIMITS.split()[:6]) in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing external
    call, _ = api
    _, run = call("GET", "/api/run")
    names = [c["name"] for c in run["configs"]]
    assert names == ["continuous", "late"]
    c = run["configs"][0]
    assert c["fluid"] == [4, 3, 2, 1, 0] and c["max_deviation"] == 2 and c["first_exceeding_t"] == 3


def test_make_server_refuses_remote():
    with pytest.raises(ValueError, match="non-loopback"):
        make_server("0.0.0.0", 0)
