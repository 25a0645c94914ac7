"""The embedded `shapes` model: red/green/blue shapes on a grey-level background."""
from .draw import COLORS, SHAPES, CONDITIONS, NULL_CONDITION, draw, classify

__all__ = ["COLORS", "SHAPES", "CONDITIONS", "NULL_CONDITION", "draw", "classify"]
