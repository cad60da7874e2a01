"""A plain Flower app and the diffs of docs/adopt.md that add correlated-noise DP to it."""
