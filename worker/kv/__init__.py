"""A worker's KV cache beyond its engine: transfers between workers (routes, staging, landing,
layer-by-layer writes), the per-rank transfer agents, and the cluster-wide KV tier."""
