"""The embedded `shapes` model: red/green/blue shapes on a grey-level background.
`draw` makes the images, `classify` reads them, `train` and `sample` use both."""
from .draw import COLORS, CONDITIONS, NULL_CONDITION, SHAPES, draw

__all__ = ["COLORS", "SHAPES", "CONDITIONS", "NULL_CONDITION", "draw"]
