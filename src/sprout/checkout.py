"""Where Sprout runs from: the checkout that an editable install (ops/setup_podman.sh) points at, with the
runtime the set-up script compiles into it (and the source it compiled it from)."""

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # src/sprout/checkout.py -> the checkout
RUNTIME_LAUNCHER = CHECKOUT / "runtime" / "sprout-runtime"
RUNTIME_SOURCE = CHECKOUT / "src" / "sprout" / "sandbox" / "runtime.c"
