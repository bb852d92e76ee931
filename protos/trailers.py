"""gRPC trailing-metadata keys shared by workers and the router (torch-free on both sides).

A decode worker that fails because its prefill worker failed names that endpoint here, so the
router blames the right one without reading error text.
"""

FAILED_ENDPOINT = "splitfire-failed-endpoint"
FAILED_ROLE = "splitfire-failed-role"
