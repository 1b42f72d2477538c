"""`python -m sprout.sandbox ...`: the seed's form of `sprout sandbox ...` (its `gc --older-than` counts hours)."""

if __name__ == "__main__":
    from ..cli import alias
    from ..cli.sandbox import seed_form

    alias(["sandbox"], seed_form)
