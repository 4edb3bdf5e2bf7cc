"""Everything between peers: the libp2p host, the signed gossip registry, placement and
routing (pure functions), and the wire protocols.

Public surface: ``p2p.host.open_host`` / ``P2PHost``, ``p2p.identity``, ``p2p.gossip.RegistryService``,
``p2p.registry`` (the reducer), ``p2p.placement``, ``p2p.routing``, ``p2p.forward.ForwardService``,
``p2p.chain.SwarmPipeline``, ``p2p.artifacts`` (``serve_artifacts`` / ``RemoteArtifacts``), ``p2p.errors``. libp2p's own types never leave this package.
"""
