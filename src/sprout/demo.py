"""`python -m sprout.demo`: the seed's form of `sprout demo`."""

if __name__ == "__main__":
    from .cli import alias

    alias("sprout.demo")
