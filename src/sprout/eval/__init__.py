"""Layer 6: evaluation over Harbor datasets — the gate (oracle must pass, nop must fail)."""
