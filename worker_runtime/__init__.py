"""The worker runtime both worker kinds share: the engine loop thread, the serving base class, the records
workers and the router exchange (protocol.py), core pinning and lending, tracing, the request log, and
bearer-token checks. `prefill_workers/` and `decode_workers/` keep only what differs between the roles."""
