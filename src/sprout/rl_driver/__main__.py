"""`python -m sprout.rl_driver ...`: the seed's form of `sprout rl-driver ...`."""

if __name__ == "__main__":
    from ..cli import alias

    alias("sprout.rl_driver")
