"""The SLO planner: sizes the prefill and decode roles separately from the fleet's own metrics."""
