"""Replicas of the engine on Ray Serve (`pip install 'mtpserve[cluster]'`; docs/cluster.md).

A gateway deployment serves the same FastAPI app as `mtpserve serve` (server.app) over a `RemoteEngine`, which
implements the engine-client protocol by sending each request to one engine replica through a Ray Serve handle and
streaming its events back; a request router picks the replica (routing.py: prefix-aware by default, so a
conversation's prompt cache stays hot). Nothing here is imported by `mtpserve serve` unless `--replicas` asks for a
cluster: the modules that need Ray import it at their top, and only this package's `protocol` and `routing` modules
load without it.
"""
