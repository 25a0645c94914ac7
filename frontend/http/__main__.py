"""`python -m frontend.http ...`, the same as `python -m frontend http ...`."""
import sys

from frontend.http.server import main

sys.exit(main())
