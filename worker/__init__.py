"""The serving shell every worker role shares: config, gRPC Worker service, metrics, lifecycle."""
