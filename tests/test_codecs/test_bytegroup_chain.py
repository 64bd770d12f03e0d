"""A bytegroup delta chain decoded in byte planes (``bytegroup.decode_chain``, what
``ObjectStore.get`` reads lossless float chains with) gives the bytes that decoding it link
by link (``decode_bytes``) gives, and refuses what that refuses; through the object store a
damaged link raises the error the link-by-link read raises (issue 43, item 10).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store import cas, object_format
from inshrink_store.codecs import bytegroup as bg
from inshrink_store.errors import FormatError, InshrinkError, IntegrityError
from inshrink_store.layout import object_path
from inshrink_store.storage import LocalStorage, open_storage

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _versions(dtype: str, n: int, links: int, seed: int, change: float, whole: list[bool]) -> list[np.ndarray]:
    """``links + 1`` versions of a chunk's bytes: trained-like weights drifting by ``change``
    per version, some versions (``whole``) unrelated to the one before (their planes code
    no smaller as XORs: the encoder then stores a keyframe, or XORs only some planes)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n).astype(np.float32) * 0.02
    out = []
    for k in range(links + 1):
        if k and whole[k % len(whole)]:
            values = rng.standard_normal(n).astype(np.float32)
        elif k:
            values = values + rng.standard_normal(n).astype(np.float32) * change
        if dtype == "float32":
            data = values.view(np.uint8)
        elif dtype == "float16":
            data = values.astype(np.float16).view(np.uint8)
        else:
            data = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        out.append(np.ascontiguousarray(data).copy())
    return out


def _by_links(chain: list[np.ndarray], dtype: str, base: np.ndarray | None) -> np.ndarray:
    out = base
    for chunk in chain:
        out = bg.decode_bytes(chunk, dtype, base=out)
    assert out is not None
    return out


chains = st.fixed_dictionaries({
    "dtype": st.sampled_from(sorted(ITEMSIZE)),
    "n": st.integers(1, 3000),
    "links": st.integers(1, 7),
    "seed": st.integers(0, 2**32 - 1),
    "change": st.sampled_from([0.0, 1e-6, 1e-4, 1e-2]),
    "whole": st.lists(st.booleans(), min_size=1, max_size=4),
    "coders": st.lists(st.sampled_from(bg.CODERS), min_size=1, max_size=4),
    "over_base": st.booleans(),
})


@settings(max_examples=150, deadline=None)
@given(spec=chains)
def test_a_chain_decoded_in_planes_equals_decoding_it_link_by_link(spec: dict) -> None:
    """Random chains of every dtype and both formats (format 1 keeps the sign in place, so a
    chain may change plane layout between links), of changes that XOR every plane, some
    planes or none: where each link above the first is a delta over the one below, the
    plane-domain decode gives the link-by-link bytes; where one is not, it is refused."""
    dtype, coders = spec["dtype"], spec["coders"]
    versions = _versions(dtype, spec["n"], spec["links"], spec["seed"], spec["change"], spec["whole"])
    base = versions[0] if spec["over_base"] else None
    first = 1 if spec["over_base"] else 0
    chain = [np.frombuffer(bg.encode_chunk(versions[k], dtype, 1, coders[k % len(coders)],
                                           base=versions[k - 1] if k else None), np.uint8)
             for k in range(first, len(versions))]
    expected = _by_links(chain, dtype, base)
    assert expected.tobytes() == versions[-1].tobytes()
    deltas = [bool(bg.parse(c)[1] & bg.FLAG_BASE) for c in chain]
    if all(deltas[1:]):  # a first link stored whole ignores the base, as decode_bytes does
        got = bg.decode_chain(chain, dtype, base=base, size=versions[-1].size)
        assert got.tobytes() == expected.tobytes()
        unhashed = bg.decode_chain(chain, dtype, base=base, size=versions[-1].size, checked=False)
        assert unhashed.tobytes() == expected.tobytes()
        for checked in (True, False):  # joined in the thread's scratch words, then copied out
            assert bg.decode_chain_to_bytes(chain, dtype, base=base, size=versions[-1].size,
                                            checked=checked) == expected.tobytes()
        top = chain[-1]
        below = _by_links(chain[:-1], dtype, base) if len(chain) > 1 else base
        assert bg.decode_to_bytes(top, dtype, base=below) == bg.decode_bytes(top, dtype, base=below).tobytes()
    else:
        with pytest.raises(IntegrityError, match="over the chunk below it"):
            bg.decode_chain(chain, dtype, base=base)
    # the longest run of deltas on top, with the chunk under it, always decodes in planes
    start = len(chain) - 1
    while start > 0 and deltas[start]:
        start -= 1
    below = _by_links(chain[:start], dtype, base) if start else base
    got = bg.decode_chain(chain[start:], dtype, base=below)
    assert got.tobytes() == versions[-1].tobytes()


def _delta_chain(links: int = 4, n: int = 6000) -> tuple[list[np.ndarray], list[np.ndarray]]:
    versions = _versions("float32", n, links, 7, 1e-4, [False])
    chain = [np.frombuffer(bg.encode_chunk(versions[k], "float32", 1, "zstd+huffman",
                                           base=versions[k - 1] if k else None), np.uint8)
             for k in range(len(versions))]
    assert all(bg.parse(c)[1] & bg.FLAG_BASE for c in chain[1:])
    return versions, chain


def test_the_chain_decode_checks_each_base_and_the_result() -> None:
    versions, chain = _delta_chain()
    assert bg.decode_chain(chain, "float32").tobytes() == versions[-1].tobytes()
    # a delta over a chunk other than the one below it
    with pytest.raises(IntegrityError, match="over the chunk below it"):
        bg.decode_chain([chain[0], chain[2]], "float32")
    # the first link a delta: its base must be the one it was encoded against
    assert bg.decode_chain(chain[1:], "float32", base=versions[0]).tobytes() == versions[-1].tobytes()
    with pytest.raises(IntegrityError, match="Expected the base chunk this chunk was encoded against"):
        bg.decode_chain(chain[1:], "float32", base=versions[1])
    with pytest.raises(FormatError, match="Got None instead"):
        bg.decode_chain(chain[1:], "float32")
    # a wrong dtype or size, an empty chain
    with pytest.raises(FormatError, match="Expected a float16 chunk"):
        bg.decode_chain(chain, "float16")
    with pytest.raises(FormatError, match="Expected a chunk of 4 bytes"):
        bg.decode_chain(chain, "float32", size=4)
    with pytest.raises(FormatError, match="at least one chunk"):
        bg.decode_chain([], "float32")


@pytest.mark.parametrize("formats", [("zstd", "zstd+huffman", "zstd+huffman", "zstd+huffman"),
                                     ("zstd", "zstd+huffman", "zstd", "zstd+huffman")])
def test_a_chain_whose_links_change_plane_layout_decodes_exactly(formats: tuple[str, ...]) -> None:
    """Format 1 keeps a float32's sign in place, format 2 moves it below the mantissa: a
    chain mixing them (a store of format-1 objects continued in format 2) is joined and
    split again where the layout changes, and decodes to the same bytes."""
    versions = _versions("float32", 20_000, 3, 1, 1e-4, [False])
    chain = [np.frombuffer(bg.encode_chunk(versions[k], "float32", 1, coder, base=versions[k - 1] if k else None),
                           np.uint8) for k, coder in enumerate(formats)]
    assert all(bg.parse(c)[1] & bg.FLAG_BASE for c in chain[1:])
    assert bg.decode_chain(chain, "float32").tobytes() == versions[-1].tobytes() == _by_links(chain, "float32", None).tobytes()


def _damage_a_plane_above_depends_on(chain: list[np.ndarray], link: int) -> list[np.ndarray]:
    """``chain`` with a byte changed in a plane of ``link`` that the result depends on (one
    the link above XORs, or any of the last link's): in a raw plane a value, in a coded one
    a byte of its stream (which then decodes to other bytes, or fails to)."""
    chunk = chain[link].copy()
    _, _, n, _, _, table = bg.parse(chunk)
    if link + 1 < len(chain):
        above = bg.parse(chain[link + 1])[5]
        plane = next(i for i, (method, _) in enumerate(above) if method in (bg.XOR_RAW, bg.XOR_ZSTD))
    else:
        plane = 0
    offset = bg.HEADER_SIZE + len(table) * bg.PLANE_SIZE + sum(length for _, length in table[:plane])
    chunk[offset + table[plane][1] // 2] ^= 0x10
    return [*chain[:link], chunk, *chain[link + 1:]]


@pytest.mark.parametrize("link", [0, 2, 4])
def test_a_plane_changed_in_a_link_the_result_depends_on_is_refused(link: int) -> None:
    """A link whose plane bytes differ from what it was written with (the chain decode never
    joins nor hashes an intermediate link) gives a result that fails the last chunk's
    checksum, or a stream that fails to decode: refused either way, whichever link it is."""
    _, chain = _delta_chain()
    with pytest.raises((FormatError, IntegrityError)):
        bg.decode_chain(_damage_a_plane_above_depends_on(chain, link), "float32")


def test_unchecked_the_result_is_not_hashed_and_a_wrong_one_is_the_callers_to_find(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``checked=False`` (issue 43, item 10): the result's xxh3-64 is left to the caller
    (the object store checks the result's id instead); the links' structure is still
    checked, and a changed plane gives other bytes instead of an error."""
    versions, chain = _delta_chain()
    hashed: list[int] = []
    checked = bg._checked
    monkeypatch.setattr(bg, "_checked", lambda out, checksum: hashed.append(out.size) or checked(out, checksum))
    assert bg.decode_chain(chain, "float32", checked=False).tobytes() == versions[-1].tobytes()
    assert hashed == []
    assert bg.decode_chain(chain, "float32").tobytes() == versions[-1].tobytes()
    assert hashed == [versions[-1].size]
    for link in range(len(chain)):  # a damaged stream may still fail to decode, never the hash
        try:
            got = bg.decode_chain(_damage_a_plane_above_depends_on(chain, link), "float32", checked=False)
        except FormatError as exc:
            assert "xxh3-64" not in str(exc)
        else:
            assert got.tobytes() != versions[-1].tobytes()
    assert hashed == [versions[-1].size]
    with pytest.raises(IntegrityError, match="over the chunk below it"):
        bg.decode_chain([chain[0], chain[2]], "float32", checked=False)


def test_the_bytes_decoders_copy_out_of_a_scratch_that_later_chunks_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode_to_bytes`` and ``decode_chain_to_bytes`` (issue 43, item 10) join in one
    buffer per thread: what they return is a copy, unchanged by the next chunk of any size
    (larger, smaller, over :data:`SCRATCH_MAX`), and any thread gets the same bytes."""
    from concurrent.futures import ThreadPoolExecutor

    chains = {n: _delta_chain(links=2, n=n) for n in (6000, 50_000, 3000, 20_000)}
    got = [bg.decode_chain_to_bytes(chain, "float32") for _, chain in chains.values()]
    got += [bg.decode_to_bytes(chain[0], "float32") for _, chain in chains.values()]
    expected = [versions[-1].tobytes() for versions, _ in chains.values()]
    expected += [versions[0].tobytes() for versions, _ in chains.values()]
    assert got == expected
    monkeypatch.setattr(bg, "SCRATCH_MAX", 40_000)  # the larger chunks get arrays of their own
    assert [bg.decode_chain_to_bytes(chain, "float32") for _, chain in chains.values()] == expected[:4]
    assert got == expected
    with ThreadPoolExecutor(4) as pool:
        many = list(pool.map(lambda item: bg.decode_chain_to_bytes(item[1], "float32"), list(chains.values()) * 8))
    assert many == expected[:4] * 8


def test_the_bytes_decoders_refuse_what_the_array_decoders_refuse() -> None:
    _, chain = _delta_chain()
    for link in range(len(chain)):
        damaged = _damage_a_plane_above_depends_on(chain, link)
        with pytest.raises((FormatError, IntegrityError)) as array:
            bg.decode_chain(damaged, "float32")
        with pytest.raises(type(array.value), match=str(array.value)[:40]):
            bg.decode_chain_to_bytes(damaged, "float32")
    for link in range(len(chain)):  # each chunk on its own, over the chunk below it
        damaged = _damage_a_plane_above_depends_on([*chain[:link + 1]], link)[link]
        below = bg.decode_chain(chain[:link], "float32") if link else None
        with pytest.raises((FormatError, IntegrityError)) as array:
            bg.decode_bytes(damaged, "float32", base=below)
        with pytest.raises(type(array.value), match=str(array.value)[:40]):
            bg.decode_to_bytes(damaged, "float32", base=below)


# -- through the object store ------------------------------------------------------------


def _store_chain(links: int = 5, n: int = 1 << 15) -> tuple[cas.ObjectStore, list[str], list[np.ndarray]]:
    storage = open_storage(f"memory://chain-{np.random.default_rng().integers(1 << 62)}")
    objects = cas.ObjectStore(storage)
    versions = _versions("float32", n, links, 3, 1e-4, [False])
    ids: list[str] = []
    for data in versions:
        ids.append(objects.put(data.tobytes(), base=ids[-1] if ids else None, element="float32").oid)
    headers = [objects.header(oid) for oid in ids]
    assert [h.depth for h in headers] == list(range(links + 1)) and all(h.coder == object_format.CODER_BYTEGROUP for h in headers)
    return objects, ids, versions


def test_the_object_store_reads_a_chain_in_planes_exactly_and_caches_only_the_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    objects, ids, versions = _store_chain()
    calls: list[int] = []
    decode_chain = bg.decode_chain_to_bytes
    monkeypatch.setattr(bg, "decode_chain_to_bytes",
                        lambda chain, *a, **k: calls.append(len(chain)) or decode_chain(chain, *a, **k))
    fresh = cas.ObjectStore(objects.storage)
    assert fresh.get(ids[-1]) == versions[-1].tobytes()
    assert calls == [len(ids)]
    assert fresh._cache.get(ids[-2]) is None and fresh._cache.get(ids[-1]) is not None
    # the version below, then the newest over it from the cache: one link, read link by link
    fresh = cas.ObjectStore(objects.storage)
    assert fresh.get(ids[-2]) == versions[-2].tobytes()
    assert fresh.get(ids[-1]) == versions[-1].tobytes()
    assert calls == [len(ids), len(ids) - 1]


@pytest.mark.parametrize("newest", [0, 2, 5])
def test_take_gives_the_payload_as_an_array_of_the_callers_own_and_caches_nothing(newest: int) -> None:
    """``ObjectStore.take`` (an export's chunk reads): get's bytes, as a new writable array,
    a lone keyframe (``newest`` 0) and chains alike decoded in planes; nothing cached, and
    from a cached payload a copy."""
    objects, ids, versions = _store_chain()
    fresh = cas.ObjectStore(objects.storage)
    taken = fresh.take(ids[newest])
    assert taken.tobytes() == versions[newest].tobytes() and taken.dtype == np.uint8
    assert taken.flags.writeable and fresh._cache._size == 0
    taken[:] = 0
    assert fresh.take(ids[newest]).tobytes() == versions[newest].tobytes()
    assert fresh.get(ids[newest]) == versions[newest].tobytes()  # cached now
    again = fresh.take(ids[newest])
    again[:] = 0
    assert fresh.get(ids[newest]) == versions[newest].tobytes()


def test_take_on_a_local_disk_reads_mapped_objects_and_raises_what_get_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a local disk ``take`` reads each link as a view of its mapped file
    (``LocalStorage.read_mapped``): the same payload, and for a damaged or a missing link the
    error ``get`` raises."""
    objects = cas.ObjectStore(open_storage(str(tmp_path / "store")))
    versions = _versions("float32", 1 << 15, 4, 5, 1e-4, [False])
    ids: list[str] = []
    for data in versions:
        ids.append(objects.put(data.tobytes(), base=ids[-1] if ids else None, element="float32").oid)
    mapped: list[str] = []
    read_mapped = LocalStorage.read_mapped
    monkeypatch.setattr(LocalStorage, "read_mapped", lambda self, path: mapped.append(path) or read_mapped(self, path))
    assert cas.ObjectStore(objects.storage).take(ids[-1]).tobytes() == versions[-1].tobytes()
    assert mapped == [object_path(oid) for oid in reversed(ids)]
    path = object_path(ids[2])
    stored = bytearray(objects.storage.read(path))
    stored[-100] ^= 0x01
    objects.storage.write(path, bytes(stored))
    got, _ = _errors(objects, ids[-1], monkeypatch)  # take's error is get's (checked there)
    assert ids[2] in got and "checksum" in got
    objects.storage.delete(path)
    got, _ = _errors(objects, ids[-1], monkeypatch)
    assert "the delta chain is broken" in got


def _rewrite(objects: cas.ObjectStore, oid: str, change: object) -> None:
    """Object ``oid`` with its body changed by ``change(body)`` and its checksum recomputed:
    damage only its decoding can find."""
    stored = objects.storage.read(object_path(oid))
    header = object_format.parse_header(oid, stored)
    body = bytearray(stored[object_format.HEADER_SIZE:])
    change(body)  # type: ignore[operator]
    objects.storage.write(object_path(oid), object_format.frame(header.kind, header.coder, header.depth, bytes(header.logical_length),
                                                        header.base, bytes(body)))


def _errors(objects: cas.ObjectStore, oid: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """(the error reading ``oid`` raises, the error reading it link by link raises)."""
    with pytest.raises(InshrinkError) as got:
        cas.ObjectStore(objects.storage).get(oid)
    with monkeypatch.context() as patch:
        patch.setattr(cas.ObjectStore, "_decode_in_planes", lambda *a: None)
        with pytest.raises(InshrinkError) as old:
            cas.ObjectStore(objects.storage).get(oid)
    assert type(got.value) is type(old.value)
    with pytest.raises(InshrinkError) as taken:  # an export's read: the same error
        cas.ObjectStore(objects.storage).take(oid)
    assert type(taken.value) is type(got.value) and str(taken.value) == str(got.value)
    return str(got.value), str(old.value)


@pytest.mark.parametrize("link", [0, 2, 4, 5])
def test_a_damaged_link_raises_the_error_a_link_by_link_read_raises(link: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    objects, ids, _ = _store_chain()
    path = object_path(ids[link])
    stored = bytearray(objects.storage.read(path))
    stored[-100] ^= 0x01  # a flipped bit: the link's checksum
    objects.storage.write(path, bytes(stored))
    got, old = _errors(objects, ids[-1], monkeypatch)
    assert got == old and ids[link] in got and "checksum" in got


@pytest.mark.parametrize("link", [0, 3, 5])
def test_a_link_written_wrong_raises_the_error_naming_it(link: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link whose body decodes to other values than its id names, behind a valid checksum
    (a writer's bug, not storage's): the chain read fails the result's checks and decodes
    link by link again, which names the link, as before."""
    objects, ids, _ = _store_chain()

    def flip_exponent_plane(body: bytearray) -> None:  # the plane every link above XORs
        table = bg.parse(np.frombuffer(bytes(body), np.uint8))[5]
        body[bg.HEADER_SIZE + len(table) * bg.PLANE_SIZE + table[0][1] // 2] ^= 0x10

    _rewrite(objects, ids[link], flip_exponent_plane)
    got, old = _errors(objects, ids[-1], monkeypatch)
    assert got == old and ids[link] in got


def test_a_missing_link_raises_the_error_a_link_by_link_read_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    objects, ids, _ = _store_chain()
    objects.storage.delete(object_path(ids[2]))
    got, old = _errors(objects, ids[-1], monkeypatch)
    assert got == old and "the delta chain is broken" in got
