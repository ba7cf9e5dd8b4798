"""``python -m timeslice_verl``: the command line, as ``timeslice-verl`` (what processes started from ours run)."""

import sys

from timeslice_verl.tools.cli import main

sys.exit(main(prog_name="timeslice-verl"))
