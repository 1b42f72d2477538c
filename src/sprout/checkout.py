"""Where Sprout runs from: the checkout that an editable install (ops/setup_podman.sh) points at, with the
runtime launcher the set-up script writes into it."""

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # src/sprout/checkout.py -> the checkout
RUNTIME_LAUNCHER = CHECKOUT / "runtime" / "sprout-runtime"
