"""Routing constraints from Python, as over HTTP (Dynamo 1.6.1's `routing_constraints`): worker
taints and the other Dynamo worker fields in the records, required taints as a filter (503 when
none is left), preferred taints as Dynamo's cost multiplier at its recorded switch points, the
routes that ignore them, and the shapes Dynamo refuses."""

from __future__ import annotations

import pytest

from kvroute import SelectionServiceError

from conftest import new_service, store, tokens, worker

PROMPT = tokens(17)


async def fleet():
    """Dynamo's recorded fleet under its weights: worker 1 (no taints) holds 16 of the 17
    prompt tokens, 2 and 3 hold nothing and carry taints."""
    svc = new_service(profile="dynamo")
    await svc.upsert_worker(worker(1))
    await svc.upsert_worker(worker(2, taints=["pref", "gpu=h100", "pref"], topology_domains={"zone": "a"}))
    await svc.upsert_worker(worker(3, taints=["gpu=a100", "other"]))
    store(svc, 1, PROMPT[:16])
    return svc


async def chosen(svc, constraints, **extra) -> int:
    selection = await svc.select({"token_ids": PROMPT, "routing_constraints": constraints, **extra})
    return selection["worker_id"]


async def no_endpoint(awaitable):
    with pytest.raises(SelectionServiceError) as info:
        await awaitable
    assert (info.value.status_code, info.value.kind, str(info.value)) == (
        503,
        "scheduler",
        "no endpoints available to route work",
    )


async def test_worker_records_carry_taints_and_dynamos_worker_fields():
    svc = new_service()
    record = await svc.upsert_worker(
        worker(
            5,
            taints=["zeta", "alpha", "zeta"],
            topology_domains={"zone": "a", "rack": "r1"},
            kv_transfer_domain="zone",
            kv_transfer_enforcement="preferred",
            kv_transfer_preferred_weight=0.85,
        )
    )
    assert record["taints"] == ["alpha", "zeta"], "a set, listed sorted"
    assert record["topology_domains"] == {"zone": "a", "rack": "r1"}
    assert (record["kv_transfer_domain"], record["kv_transfer_enforcement"]) == ("zone", "preferred")
    assert record["kv_transfer_preferred_weight"] == 0.85
    plain = await svc.upsert_worker(worker(6))
    assert (plain["taints"], plain["topology_domains"], plain["kv_transfer_enforcement"]) == ([], {}, None)
    patched = await svc.patch_worker(5, {"taints": ["beta"]})
    assert patched["taints"] == ["beta"]
    assert patched["topology_domains"] == {"zone": "a", "rack": "r1"}, "PATCH replaces what it names"
    assert svc.list_workers()[0]["taints"] == ["beta"]
    svc.shutdown()


async def test_required_taints_are_a_hard_filter():
    svc = await fleet()
    assert await chosen(svc, {}) == 1
    assert await chosen(svc, {"required_taints": ["gpu=h100"]}) == 2
    assert await chosen(svc, {"required_taints": ["gpu=a100"]}) == 3
    assert await chosen(svc, [["gpu=h100", "pref"]]) == 2, "serde's sequence form"
    await no_endpoint(chosen(svc, {"required_taints": ["gpu=h100", "gpu=a100"]}))
    await no_endpoint(chosen(svc, {"required_taints": ["dynamo.topology/zone=a"]}))
    pinned = {"pinned_worker": {"worker_id": 1, "dp_rank": 0}}
    await no_endpoint(chosen(svc, {"required_taints": ["gpu=h100"]}, **pinned))
    await no_endpoint(chosen(svc, {"required_taints": ["gpu=h100"]}, allowed_worker_ids=[1, 3]))
    await no_endpoint(
        svc.select_and_reserve(
            {"token_ids": PROMPT, "selection_id": "c-2", "routing_constraints": {"required_taints": ["nope"]}}
        )
    )
    booked = await svc.select_and_reserve(
        {"token_ids": PROMPT, "selection_id": "c-1", "routing_constraints": {"required_taints": ["gpu=a100"]}}
    )
    assert booked["worker_id"] == 3
    # Inspection ignores them, as Dynamo does.
    nope = {"token_ids": PROMPT, "routing_constraints": {"required_taints": ["nope"]}}
    assert len((await svc.overlap_scores(nope))["workers"]) == 3
    assert len(await svc.potential_loads(nope)) == 3
    svc.shutdown()


async def test_preferred_taints_move_the_pick_where_dynamo_moved_it():
    svc = await fleet()
    for weight, want in [(0.5, 1), (1.0, 2), (5.0, 2), (-5.0, 1), (0.0, 1)]:
        assert await chosen(svc, {"preferred_taints": {"pref": weight}}) == want, weight
    assert await chosen(svc, {"preferred_taints": {"pref": 5.0, "gpu=h100": -5.0}}) == 1, "they cancel"
    assert await chosen(svc, [[], {"pref": 5.0}]) == 2
    cold = {"allowed_worker_ids": [2, 3]}
    assert await chosen(svc, {"preferred_taints": {"pref": 1.0, "other": 2.0}}, **cold) == 3
    assert await chosen(svc, {"preferred_taints": {"pref": 2.0, "other": 1.0}}, **cold) == 2
    await svc.patch_worker(1, {"taints": ["spot"]})
    warm = {"allowed_worker_ids": [1, 2]}
    assert await chosen(svc, {"preferred_taints": {"spot": -0.5}}, **warm) == 1
    assert await chosen(svc, {"preferred_taints": {"spot": -1.0}}, **warm) == 2
    svc.shutdown()


@pytest.mark.parametrize(
    "body, message",
    [
        ({"routing_constraints": None}, "routing_constraints: invalid type: null, expected struct RoutingConstraints"),
        (
            {"routing_constraints": {"required_taints": [1]}},
            "routing_constraints.required_taints[0]: invalid type: integer `1`, expected a string",
        ),
        (
            {"routing_constraints": {"preferred_taints": ["pref"]}},
            "routing_constraints.preferred_taints: invalid type: sequence, expected a map",
        ),
        (
            {"routing_constraints": {"preferred_taints": {"pref": "high"}}},
            'routing_constraints.preferred_taints.pref: invalid type: string "high", expected f32',
        ),
        # Over HTTP, serde's words for JSON text: `trailing characters` (a 400, as in Dynamo).
        ({"routing_constraints": [[], {}, 1]}, "routing_constraints: invalid length 3, expected fewer elements"),
    ],
)
async def test_bad_constraints_raise_value_error_naming_the_field(body, message):
    svc = await fleet()
    with pytest.raises(ValueError) as info:
        svc.select({"token_ids": PROMPT, **body})
    assert message in str(info.value)
    for extra, message in [
        ({"taints": None}, "taints: invalid type: null, expected a sequence"),
        ({"topology_domains": {"zone": 5}}, "topology_domains.zone: invalid type: integer `5`, expected a string"),
        (
            {"kv_transfer_enforcement": "strict"},
            "kv_transfer_enforcement: unknown variant `strict`, expected `required` or `preferred`",
        ),
    ]:
        with pytest.raises(ValueError) as info:
            svc.upsert_worker(worker(10, **extra))
        assert message in str(info.value)
    svc.shutdown()
