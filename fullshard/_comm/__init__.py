"""The communication layer: fullshard's collectives (bounded, counted, checked for
mismatches), their transports (shared memory between ranks of one host, gloo rings, c10d)
and the process groups a unit shards and replicates over.

It imports nothing of fullshard above it (only the public enums of ``fullshard.api``); the
engine, the features and the front doors build on it. See docs/architecture.md.
"""
