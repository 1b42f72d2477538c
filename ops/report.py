"""`python -m ops.report ...` from a checkout: the seed's form of `sprout report ...`."""

from sprout.cli import alias

if __name__ == "__main__":
    alias("ops.report")
