"""Load tests and benchmarks: each prints ratios measured side by side in one run."""
