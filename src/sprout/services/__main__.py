"""`python -m sprout.services ...`: the seed's form of `sprout services ...`."""

if __name__ == "__main__":
    from ..cli import alias

    alias("sprout.services")
