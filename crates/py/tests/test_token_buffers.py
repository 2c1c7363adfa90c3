"""`token_ids` as a buffer (array, numpy array, bytes, memoryview): the same answers as the list
form, read without a Python int per token; forms that are not token ids are refused naming the
field."""

from __future__ import annotations

import array
import struct

import pytest

import kvroute
from conftest import store, tokens, with_workers


def forms(prompt: list[int]) -> dict:
    """The prompt in every accepted form but the list."""
    out = {
        "array_I": array.array("I", prompt),
        "array_i": array.array("i", prompt),
        "array_q": array.array("q", prompt),
        "array_Q": array.array("Q", prompt),
        "bytes_le": struct.pack(f"<{len(prompt)}I", *prompt),
        "bytearray_le": bytearray(struct.pack(f"<{len(prompt)}I", *prompt)),
        "memoryview_I": memoryview(array.array("I", prompt)),
        "memoryview_bytes": memoryview(struct.pack(f"<{len(prompt)}I", *prompt)),
        # Every other item of a twice-as-long array: not contiguous.
        "strided": memoryview(array.array("I", [t for p in prompt for t in (p, 7)]))[::2],
    }
    try:
        import numpy as np
    except ImportError:
        return out
    out["numpy_uint32"] = np.asarray(prompt, dtype=np.uint32)
    out["numpy_int64"] = np.asarray(prompt, dtype=np.int64)
    out["numpy_big_endian_u32"] = np.asarray(prompt, dtype=">u4")
    return out


def comparable(selection: dict) -> dict:
    return {k: v for k, v in selection.items() if k != "selection_id"}


async def test_every_buffer_form_selects_as_the_list_does():
    svc = await with_workers(1, 2, 3)
    # Three different holders, so the answer depends on reading the prompt right.
    prompt = [(t * 2_654_435_761) % 150_000 for t in range(1, 42)]
    store(svc, 2, prompt[:16])
    store(svc, 3, prompt[:32])
    expected = await svc.select({"token_ids": prompt})
    assert expected["worker_id"] == 3 and expected["overlap"]["gpu"] == 32
    for name, form in forms(prompt).items():
        got = await svc.select({"token_ids": form})
        assert comparable(got) == comparable(expected), name
        scores = await svc.overlap_scores({"token_ids": form})
        assert scores == await svc.overlap_scores({"token_ids": prompt}), name
    svc.shutdown()


async def test_buffer_select_then_replay_books_the_same_prompt():
    svc = await with_workers(1, 2)
    prompt = tokens(17)
    sel = await svc.select({"token_ids": array.array("I", prompt), "selection_id": "s"})
    res = await svc.create_reservation({"selection_id": "s"})
    assert res["worker_id"] == sel["worker_id"]
    booked = await svc.select_and_reserve({"token_ids": struct.pack("<17I", *prompt)})
    assert booked["isl_tokens"] == 17
    assert booked["sequence_hashes"] == kvroute.block_hashes(prompt, 4)["sequence_hashes"]
    svc.shutdown()


@pytest.mark.parametrize(
    "value, error, message",
    [
        (array.array("H", [1, 2, 3]), TypeError, "token_ids: a buffer of format 'H' (2-byte items)"),
        (array.array("f", [1.0, 2.0]), TypeError, "token_ids: a buffer of format 'f'"),
        (array.array("d", [1.0]), TypeError, "token_ids: a buffer of format 'd'"),
        (b"\x01\x00\x00\x00\x02\x00", ValueError,
         "token_ids: 6 bytes are not a whole number of little-endian u32 token ids"),
        (array.array("i", [5, 6, -1]), ValueError, "token_ids[2]: -1 is not a token id"),
        (array.array("q", [1, 2**32]), ValueError, "token_ids[1]: 4294967296 is not a token id"),
        (memoryview(bytes(16)).cast("I", (2, 2)), ValueError,
         "token_ids: a buffer of token ids must be one-dimensional"),
    ],
)
async def test_a_buffer_that_is_not_token_ids_is_refused_naming_the_field(value, error, message):
    svc = await with_workers(1)
    with pytest.raises(error) as info:
        await svc.select({"token_ids": value})
    assert str(info.value).startswith(message), str(info.value)
    svc.shutdown()


async def test_an_empty_buffer_is_refused_like_an_empty_list():
    svc = await with_workers(1)
    with pytest.raises(ValueError) as from_list:
        await svc.select({"token_ids": []})
    with pytest.raises(ValueError) as from_buffer:
        await svc.select({"token_ids": array.array("I")})
    assert str(from_buffer.value) == str(from_list.value)
    svc.shutdown()


async def test_numpy_refusals_name_the_field():
    np = pytest.importorskip("numpy")
    svc = await with_workers(1)
    with pytest.raises(TypeError, match=r"^token_ids: a buffer of format 'e'"):
        await svc.select({"token_ids": np.ones(4, dtype=np.float16)})
    with pytest.raises(TypeError, match=r"^token_ids: a buffer of format 'H'"):
        await svc.select({"token_ids": np.ones(4, dtype=np.uint16)})
    with pytest.raises(ValueError, match=r"^token_ids\[1\]: -3 is not a token id"):
        await svc.select({"token_ids": np.array([1, -3], dtype=np.int64)})
    svc.shutdown()
