"""``GET /v1/models`` and ``/v1/models/:id`` over the registry's coverage, without a swarm."""

from __future__ import annotations

from api.app import create_app
from api.limits import RequestLimits
from inclavate.types import LayerRange, ModelId
from p2p.coverage import ModelCoverage


class _Context:
    """Enough of a PeerContext for the model routes: the registry's coverage."""

    version = "test"
    peer_id = "local"
    admin_token = None
    limits = RequestLimits()

    def __init__(self, coverage: dict[ModelId, ModelCoverage]) -> None:
        self._coverage = coverage

    def coverage(self) -> dict[ModelId, ModelCoverage]:
        return self._coverage


def _coverage(model: str, **states: int) -> ModelCoverage:
    counts = {"Ready": 0, "Joining": 0, "Degraded": 0, "Dead": 0, "Idle": 0, **states}
    return ModelCoverage(model_id=ModelId(model), n_layers=30, d_model=576, ranges=(), gaps=(LayerRange(0, 30),),
                         chain_complete=False, states=counts, node_count=sum(states.values()))  # fmt: skip


async def test_a_model_whose_every_node_left_is_neither_listed_nor_retrieved() -> None:
    """A departed node's record stays in the registry, Dead, until dropped (~60 s at 2 s
    beats); before, its model stayed in ``/v1/models`` and ``models.retrieve`` answered 200
    all that time, though README promises a 404 "for an id no node serves"."""
    client = create_app(_Context({
        ModelId("gone:1"): _coverage("gone:1", Dead=2),
        ModelId("here:1"): _coverage("here:1", Ready=1, Dead=1),
        ModelId("coming:1"): _coverage("coming:1", Joining=1),
    })).test_client()  # type: ignore[arg-type]  # fmt: skip
    listed = await (await client.get("/v1/models")).get_json()
    assert [m["id"] for m in listed["data"]] == ["here:1", "coming:1"]
    assert (await client.get("/v1/models/gone:1")).status_code == 404
    assert (await client.get("/v1/models/here:1")).status_code == 200
