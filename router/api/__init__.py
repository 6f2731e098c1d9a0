"""The ingress's API surface: the OpenAI-compatible HTTP API on Ray Serve (validation, auth, admission,
tokenization, output parsing, audit, traces). Imports router.placement, never the other way."""
