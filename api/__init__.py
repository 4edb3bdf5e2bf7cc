"""The REST API every peer serves (quart-trio on hypercorn).

Public surface: ``api.app.create_app`` / ``serve_api`` over an ``api.context.PeerContext``;
``api.errors`` is the one place exceptions become HTTP statuses and the spec's JSON shapes.
"""
