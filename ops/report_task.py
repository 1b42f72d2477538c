"""`python -m ops.report_task DIR` from a checkout: the seed's form of `sprout report task DIR`."""

from sprout.cli import alias

if __name__ == "__main__":
    alias("ops.report_task")
