"""Data-quality gates (Great Expectations) between scoring and the update."""
