"""Fluid model of admission pressure.

The backlog ``q(t)`` of a queue fed at offered rate ``lambda`` (arrival, requests
per unit time) and drained at service rate ``mu`` follows

    dq/dt = lambda - mu    while q > 0, and q never goes below 0.

With constant rates from an anchor ``(t_a, q_a)`` the closed form is

    q(t) = max(0, q_a + (lambda - mu) * (t - t_a))        for t >= t_a,

and the backlog first reaches 0 at ``t_a + q_a / (mu - lambda)`` when ``mu > lambda``
(at ``t_a`` itself when ``q_a == 0`` and ``lambda <= mu``); it never drains when
``lambda >= mu`` and ``q_a > 0``.

Exactness: every quantity is held as a :class:`fractions.Fraction`. Rates given as
decimal strings ("0.1") are taken exactly as written, floats exactly as their binary
value; time advances in exact steps of 1/2 (``t = k/2`` after ``k`` steps) and each
backlog is evaluated from the closed form, never by accumulating floats. Public
results are floats rounded once from the exact value; ``*_exact`` accessors give the
Fractions themselves.

What this model does NOT have: batch slots, solver coordinates, cancellation events,
GPU completion or decode memory. It is a fluid approximation of admission pressure
and nothing more; ``python -m engine queue-instrument --from-run`` puts a backlog the
real engine measured beside it to show where it stops holding.
"""
from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction
from numbers import Rational, Real
from typing import NamedTuple

__all__ = ["FluidQueue", "Prediction", "LIMITS", "STEP", "INITIAL_BACKLOG", "to_fraction"]

#: Time advanced by one :meth:`FluidQueue.step`.
STEP = Fraction(1, 2)
#: Backlog after :meth:`FluidQueue.reset` (unless the queue was built with another).
INITIAL_BACKLOG = Fraction(4)

#: The honest-limits sentence, shown by the CLI and the page.
LIMITS = (
    "This is a fluid model only: it has no batch slots, no solver coordinates, "
    "no cancellation events, no GPU completion and no decode memory. "
    "The real engine's backlog can differ from it; --from-run RESULTS.json shows "
    "a measured backlog beside the prediction, so you can see where the model "
    "stops holding."
)


class Prediction(NamedTuple):
    """Result of :meth:`FluidQueue.predict`.

    ``backlog`` is q(t); ``drain_time`` is the absolute time at which the backlog
    first reaches 0 under the current rates, or ``None`` when it never drains.
    """

    backlog: float
    drain_time: float | None


def to_fraction(value, name: str) -> Fraction:
    """Convert ``value`` (int, float, Fraction, Decimal or decimal string) exactly.

    Raises ValueError naming ``name`` for NaN, infinities, booleans and text that
    is not a number.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got a boolean ({value!r})")
    if isinstance(value, Fraction):
        return value
    if isinstance(value, Rational):  # int and friends
        return Fraction(value)
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise ValueError(f"{name} must be a number, got an empty string")
        try:
            dec = Decimal(text)
        except Exception:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
        if dec.is_nan():
            raise ValueError(f"{name} must not be NaN")
        if dec.is_infinite():
            raise ValueError(f"{name} must be finite, got {value!r}")
        return Fraction(dec)
    if isinstance(value, Decimal):
        if value.is_nan():
            raise ValueError(f"{name} must not be NaN")
        if value.is_infinite():
            raise ValueError(f"{name} must be finite, got {value!r}")
        return Fraction(value)
    if isinstance(value, Real):
        f = float(value)
        if math.isnan(f):
            raise ValueError(f"{name} must not be NaN")
        if math.isinf(f):
            raise ValueError(f"{name} must be finite, got {f!r}")
        return Fraction(f)
    raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")


def _rate(value, name: str) -> Fraction:
    r = to_fraction(value, name)
    if r < 0:
        raise ValueError(f"{name} must be >= 0, got {float(r)!r}")
    return r


def _opt_float(x: Fraction | None) -> float | None:
    return None if x is None else float(x)


class FluidQueue:
    """Fluid queue: backlog q(t) with arrival rate lambda and service rate mu.

    >>> q = FluidQueue(); q.reset(); q.set_rates(4, 3)
    >>> q.predict(2)
    Prediction(backlog=6.0, drain_time=None)
    >>> [q.step() for _ in range(4)][-1]
    (2.0, 6.0)

    The rates are piecewise constant: :meth:`set_rates` takes effect at the current
    time ``t`` from the current backlog (the *anchor*). :meth:`reset` returns to
    ``t = 0`` and the initial backlog and keeps the rates.
    """

    def __init__(self, arrival=0, service=0, initial_backlog=INITIAL_BACKLOG):
        q0 = to_fraction(initial_backlog, "initial backlog")
        if q0 < 0:
            raise ValueError(f"initial backlog must be >= 0, got {float(q0)!r}")
        self._initial = q0
        self._arrival = _rate(arrival, "arrival rate")
        self._service = _rate(service, "service rate")
        self.reset()

    # -- state -------------------------------------------------------------------
    def reset(self) -> None:
        """t = 0, backlog = the initial backlog (4 unless built otherwise); rates kept."""
        self._steps = 0
        self._anchor_t = Fraction(0)
        self._anchor_q = self._initial

    def set_rates(self, arrival, service) -> None:
        """Set lambda (arrival) and mu (service), effective from the current time.

        Raises ValueError, naming the rate, for a negative, NaN or infinite rate or
        anything that is not a number. Setting the rates already in force changes
        nothing (the anchor stays where it is).
        """
        lam = _rate(arrival, "arrival rate")
        mu = _rate(service, "service rate")
        if lam == self._arrival and mu == self._service:
            return
        t = self.t_exact
        self._anchor_q = self._backlog_at(t)
        self._anchor_t = t
        self._arrival, self._service = lam, mu

    def step(self) -> tuple[float, float]:
        """Advance t by 0.5 and return ``(t, backlog)`` at the new time."""
        self._steps += 1
        t = self.t_exact
        return float(t), float(self._backlog_at(t))

    def predict(self, t) -> Prediction:
        """Backlog at absolute time ``t`` and the drain time, under the current rates.

        ``t`` must not lie before the time the current rates took effect
        (:attr:`anchor_t`; 0 after a reset).
        """
        backlog, drain = self.predict_exact(t)
        return Prediction(float(backlog), _opt_float(drain))

    def predict_exact(self, t) -> tuple[Fraction, Fraction | None]:
        """Like :meth:`predict`, with exact Fractions."""
        tf = to_fraction(t, "t")
        if tf < self._anchor_t:
            raise ValueError(
                f"t must be >= {float(self._anchor_t)!r}, the time the current rates took effect"
            )
        return self._backlog_at(tf), self.drain_time_exact()

    def drain_time_exact(self) -> Fraction | None:
        """Absolute time the backlog first reaches 0 under the current rates, or None."""
        lam, mu, qa, ta = self._arrival, self._service, self._anchor_q, self._anchor_t
        if qa == 0:
            return ta if lam <= mu else None
        if mu > lam:
            return ta + qa / (mu - lam)
        return None

    def curve_exact(self, t_end) -> list[tuple[Fraction, Fraction]]:
        """Breakpoints ``(t, q)`` of the predicted piecewise-linear backlog from the
        anchor to ``t_end`` (the anchor, the drain point if it lies inside, the end)."""
        te = to_fraction(t_end, "t_end")
        ta = self._anchor_t
        pts = [(ta, self._anchor_q)]
        if te <= ta:
            return pts
        drain = self.drain_time_exact()
        if drain is not None and ta < drain < te:
            pts.append((drain, Fraction(0)))
        pts.append((te, self._backlog_at(te)))
        return pts

    def curve(self, t_end) -> list[tuple[float, float]]:
        return [(float(t), float(q)) for t, q in self.curve_exact(t_end)]

    def _backlog_at(self, t: Fraction) -> Fraction:
        q = self._anchor_q + (self._arrival - self._service) * (t - self._anchor_t)
        return q if q > 0 else Fraction(0)

    # -- read-only views ---------------------------------------------------------
    @property
    def t_exact(self) -> Fraction:
        return self._steps * STEP

    @property
    def backlog_exact(self) -> Fraction:
        return self._backlog_at(self.t_exact)

    @property
    def t(self) -> float:
        return float(self.t_exact)

    @property
    def backlog(self) -> float:
        return float(self.backlog_exact)

    @property
    def arrival(self) -> float:
        return float(self._arrival)

    @property
    def service(self) -> float:
        return float(self._service)

    @property
    def anchor_t(self) -> float:
        return float(self._anchor_t)

    @property
    def anchor_backlog(self) -> float:
        return float(self._anchor_q)

    @property
    def steps(self) -> int:
        return self._steps

    def __repr__(self) -> str:
        return (
            f"FluidQueue(t={self.t!r}, backlog={self.backlog!r}, "
            f"arrival={self.arrival!r}, service={self.service!r})"
        )
