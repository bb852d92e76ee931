"""The KV data plane: the only code that talks to the Mooncake Transfer Engine."""
