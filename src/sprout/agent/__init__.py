"""Layer 2: mini-swe-agent (unmodified) over Sprout sandboxes, a checkpoint and a journal line per turn."""

import os

# mini-swe-agent prints a banner on import, and litellm fetches a price map from the internet unless
# told to use its bundled copy: both must be set before either package is imported.
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
