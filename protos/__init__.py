"""Generated gRPC code for `splitfire.proto` (regenerate with `make protos`; a test checks it is current)."""
