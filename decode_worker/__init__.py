"""The decode worker (and the colocated role): owns KV blocks, gets prompts prefilled, streams tokens."""
