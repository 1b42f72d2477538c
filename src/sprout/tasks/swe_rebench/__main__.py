"""`python -m sprout.tasks.swe_rebench ...`: the seed's form of `sprout swe-rebench ...`."""

if __name__ == "__main__":
    from ...cli import alias

    alias("sprout.tasks.swe_rebench")
