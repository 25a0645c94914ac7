"""Admission's accounting: every byte a request will hold, reserved before it is admitted.

One source for the sizes: the output bound is `engine.protocol.output_nbytes`, the same
number the engine process holds against a client's output budget.
"""
from __future__ import annotations

import dataclasses
import math

from engine.protocol import output_nbytes

# float32 rows per slot: latents + multistep history + noise workspace + two model-input
# rows + two model-output rows
TRAJECTORY_ROWS = 7


@dataclasses.dataclass
class Reservation:
    trajectory_bytes: int
    output_bytes: int
    decode_buffers: int = 1


class Ledger:
    """Admission's accounting: trajectory memory, decode buffers, output bytes."""

    def __init__(self, trajectory_bytes: int, decode_buffers: int, output_bytes: int, parked_bytes: int = 0):
        self.capacity = Reservation(trajectory_bytes, output_bytes, decode_buffers)
        self.used = Reservation(0, 0, 0)
        # host memory for parked requests' slot state (a preempted request's trajectory bytes)
        self.parked_capacity, self.parked_used = parked_bytes, 0

    def could_ever_fit(self, r: Reservation) -> bool:
        c = self.capacity
        return r.trajectory_bytes <= c.trajectory_bytes and r.output_bytes <= c.output_bytes

    def fits(self, r: Reservation) -> bool:
        c, u = self.capacity, self.used
        return (u.trajectory_bytes + r.trajectory_bytes <= c.trajectory_bytes
                and u.output_bytes + r.output_bytes <= c.output_bytes
                and u.decode_buffers + r.decode_buffers <= c.decode_buffers)

    def take(self, r: Reservation) -> None:
        self.used.trajectory_bytes += r.trajectory_bytes
        self.used.output_bytes += r.output_bytes
        self.used.decode_buffers += r.decode_buffers

    def fits_trajectory(self, r: Reservation) -> bool:
        """A parked request's trajectory again (its decode and output reservation it kept)."""
        return self.used.trajectory_bytes + r.trajectory_bytes <= self.capacity.trajectory_bytes

    def can_park(self, r: Reservation) -> bool:
        return self.parked_used + r.trajectory_bytes <= self.parked_capacity

    def park(self, r: Reservation) -> None:
        """Its trajectory bytes move from the device budget to the parked host budget."""
        self.used.trajectory_bytes -= r.trajectory_bytes
        self.parked_used += r.trajectory_bytes

    def resume(self, r: Reservation) -> None:
        self.parked_used -= r.trajectory_bytes
        self.used.trajectory_bytes += r.trajectory_bytes

    def drop_parked(self, r: Reservation) -> None:
        """A parked request ends (canceled): its host bytes go."""
        self.parked_used -= r.trajectory_bytes
        r.trajectory_bytes = 0

    def give_back_trajectory(self, r: Reservation) -> None:
        self.used.trajectory_bytes -= r.trajectory_bytes
        r.trajectory_bytes = 0

    def give_back_part(self, r: Reservation, nbytes: int) -> None:
        """Return part of a trajectory reservation early: what the request no longer holds
        (an input kind's `spent` bytes, e.g. an encoded image once prepared)."""
        nbytes = min(nbytes, r.trajectory_bytes)
        self.used.trajectory_bytes -= nbytes
        r.trajectory_bytes -= nbytes

    def give_back_decode(self, r: Reservation) -> None:
        self.used.output_bytes -= r.output_bytes
        self.used.decode_buffers -= r.decode_buffers
        r.output_bytes = r.decode_buffers = 0


def reservation_for(latent_shape: tuple[int, ...], height: int, width: int, output: str,
                    conditioning_bytes: int = 0, input_bytes: int = 0) -> Reservation:
    """What one request holds: its trajectory state, conditioning rows and per-request
    inputs (each input kind's `nbytes`) while it denoises, then its decode buffer and
    output bytes until its output is delivered."""
    trajectory = 4 * math.prod(latent_shape) * TRAJECTORY_ROWS + conditioning_bytes + input_bytes
    return Reservation(trajectory, output_nbytes(output, height, width, latent_shape))

