"""Transfer failures, with the peer and the request they concern."""


class TransferError(Exception):
    """A KV write failed or timed out; the destination blocks may still receive late writes."""


class TransferSetupError(TransferError):
    """The transfer engine could not start, register memory, or reach a peer."""
