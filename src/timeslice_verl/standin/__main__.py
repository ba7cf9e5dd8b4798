"""``python -m timeslice_verl.standin``: the stand-in vLLM as its own process (what ``tenant standin`` runs)."""

import sys

from timeslice_verl.standin.server import main

sys.exit(main())
