"""Reports: journals as tables and Markdown, evaluations as trees (what `sprout report` prints)."""
