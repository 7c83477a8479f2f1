"""The -kernel of VMs started from saved state (D96): the real bzImage's setup sectors and a
token payload, made once per kernel file; not a bzImage -> None (the real one is used)."""

from __future__ import annotations

from pathlib import Path

from dsec.backends.vm.stubkernel import restore_kernel, setup_size


def _bzimage(path: Path, setup_sects: int, payload: int) -> bytes:
    n = (setup_sects + 1) * 512 + payload
    data = bytearray(bytes(range(256)) * (n // 256 + 1))[:n]
    data[0x1F1] = setup_sects
    data[0x202:0x206] = b"HdrS"
    path.write_bytes(bytes(data))
    return bytes(data)


def test_the_stub_is_the_setup_header_of_the_real_kernel(tmp_path: Path) -> None:
    real = _bzimage(tmp_path / "vmlinuz", 39, 8 << 20)
    stub = restore_kernel(tmp_path / "vmlinuz", tmp_path / "stub")
    assert stub is not None and stub.parent == tmp_path / "stub"
    body = stub.read_bytes()
    assert setup_size(real) == 40 * 512
    assert len(body) < 64 << 10 and body == real[:len(body)] and len(body) > setup_size(real)
    assert restore_kernel(tmp_path / "vmlinuz", tmp_path / "stub") == stub     # made once
    assert [p.name for p in (tmp_path / "stub").iterdir()] == [stub.name]      # no temp file left


def test_a_new_kernel_file_gets_its_own_stub(tmp_path: Path) -> None:
    _bzimage(tmp_path / "vmlinuz", 39, 1 << 20)
    a = restore_kernel(tmp_path / "vmlinuz", tmp_path / "stub")
    _bzimage(tmp_path / "vmlinuz", 30, 2 << 20)      # upgraded in place
    b = restore_kernel(tmp_path / "vmlinuz", tmp_path / "stub")
    assert a != b and b is not None and b.read_bytes()[0x1F1] == 30


def test_not_a_bzimage_keeps_the_real_kernel(tmp_path: Path) -> None:
    (tmp_path / "elf").write_bytes(b"\x7fELF" + bytes(70000))
    assert restore_kernel(tmp_path / "elf", tmp_path / "stub") is None
    assert not (tmp_path / "stub").exists()
