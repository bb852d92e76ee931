"""The prefill worker: computes prompts and writes their K/V into decode workers, layer by layer."""
