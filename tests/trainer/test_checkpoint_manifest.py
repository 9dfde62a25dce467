"""Issue 44 item 9: a damaged ``manifest.json`` is refused as the manifest's damage. A flipped
byte in a file's digest inside the manifest used to be blamed on that file (``linked.json``);
the manifest now carries a checksum of itself (``self_xxh3_128``)."""
import json

import pytest

from megatrain_nb.manifest import MANIFEST, SELF, IntegrityError, verify_manifest, write_manifest


def _folder(tmp_path):
    (tmp_path / "linked.json").write_text(json.dumps({"format": 2, "units": ["embed"]}))
    (tmp_path / "ram_state.safetensors").write_bytes(b"\x01" * 300)
    (tmp_path / "megatrain_state.json").write_text(json.dumps({"global_step": 2}))
    write_manifest(tmp_path)
    return tmp_path


def test_a_damaged_manifest_is_named_not_the_file_whose_digest_it_lost(tmp_path):
    folder = _folder(tmp_path)
    path = folder / MANIFEST
    good = path.read_bytes()
    text = good.decode()
    at = text.index(json.loads(text)["files"]["linked.json"]["chunks"][0]) + 3   # a hex digit of linked.json's digest
    blamed = []
    for pos in sorted(set(range(0, len(good), 3)) | {at}):
        bad = bytearray(good)
        bad[pos] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(IntegrityError) as err:
            verify_manifest(folder)
        msg = str(err.value)
        assert f"its {MANIFEST} is damaged" in msg and f"{str(path)!r} is the damaged file" in msg, (pos, msg)
        blamed += [pos] if "linked.json" in msg or "does not match its checksum" in msg else []
    assert not blamed, f"a damaged manifest blamed on another file at bytes {blamed[:5]}"
    path.write_bytes(good)
    assert verify_manifest(folder) and SELF in json.loads(good)


def test_a_manifest_written_before_it_checked_itself_still_verifies(tmp_path):
    folder = _folder(tmp_path)
    old = json.loads((folder / MANIFEST).read_text())
    old.pop(SELF)
    (folder / MANIFEST).write_text(json.dumps(old))
    assert verify_manifest(folder)
    (folder / "linked.json").write_text("{}")       # and a damaged file is still named
    with pytest.raises(IntegrityError, match="linked.json"):
        verify_manifest(folder)
