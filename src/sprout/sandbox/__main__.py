"""`python -m sprout.sandbox ...`: the seed's form of `sprout sandbox ...` (its `gc --older-than` counts hours)."""

if __name__ == "__main__":
    from ..cli import alias

    alias("sprout.sandbox")
