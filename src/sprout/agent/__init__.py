"""Layer 2: mini-swe-agent (unmodified) over Sprout sandboxes, a checkpoint and a journal line per turn."""

import os

# mini-swe-agent prints a banner on import unless this is set before it is imported.
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
