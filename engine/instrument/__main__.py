"""``python -m engine.instrument``: the same CLI as ``python -m engine queue-instrument``."""
import sys

from engine.instrument.cli import main

sys.exit(main())
