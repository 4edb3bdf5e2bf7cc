"""Inclavate: large language models run across volunteers' machines as a peer-to-peer swarm.

Packages: ``inclavate`` (CLI, config, model store, shared types), ``p2p`` (host, identity,
gossip registry, placement, routing, wire protocol), ``node`` (layer engines, sessions),
``api`` (the REST app). See docs/ARCHITECTURE.md.
"""

__version__ = "0.1.0"
