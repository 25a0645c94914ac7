"""Number formatting shared by the CLI, the --from-run report, the plot and the page:
exact where the value has a finite decimal expansion."""
from __future__ import annotations

import math
from fractions import Fraction

__all__ = ["fmt"]


def fmt(x: Fraction | float | int | None, never: str = "never") -> str:
    """Format an exact value: integers plainly, finite decimals exactly, else 12 digits."""
    if x is None:
        return never
    if not isinstance(x, Fraction):
        if isinstance(x, float) and not math.isfinite(x):
            return repr(x)
        x = Fraction(x)
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    twos = fives = 0
    while d % 2 == 0:
        d //= 2
        twos += 1
    while d % 5 == 0:
        d //= 5
        fives += 1
    if d == 1 and max(twos, fives) <= 12:
        digits = max(twos, fives)
        scaled = x * 10**digits
        sign = "-" if scaled < 0 else ""
        n = abs(scaled.numerator)
        s = str(n).rjust(digits + 1, "0")
        return f"{sign}{s[:-digits]}.{s[-digits:]}".rstrip("0").rstrip(".")
    return f"{float(x):.12g}"
