"""`python -m sprout.worker doctor|run|serve`: the seed's forms of `sprout doctor`, `sprout run` and
`sprout worker serve`."""

if __name__ == "__main__":
    from ..cli import alias

    alias("sprout.worker")
