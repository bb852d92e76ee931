"""The model runtime shared by the prefill worker, the decode worker and the colocated role."""
