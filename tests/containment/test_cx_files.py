"""Attacks on files: host files, the platform's state, the neighbour's writable layer, shared images."""

from __future__ import annotations

import secrets

import pytest

from dsec.sdk.client import Sandbox
from dsec.types import DsecError, NotFound

from containment._util import py, sh, sha256


async def test_file_api_dotdot_traversal(attacker, host_canary):
    """`..` in file-API paths (read, write, list, remove) resolves inside the sandbox root: the host canary is never read or written."""
    dots = "../" * 12
    with pytest.raises(NotFound):
        await attacker.files.read(f"{dots}{str(host_canary).lstrip('/')}")
    with pytest.raises(NotFound):
        await attacker.files.read(f"/work/{dots}{str(host_canary).lstrip('/')}")
    # a write "through" the traversal lands inside the sandbox (or is refused), never on the host
    try:
        await attacker.files.write(f"/tmp/{dots}{str(host_canary).lstrip('/')}", b"owned", mkdirs=True)
    except DsecError:
        pass
    with pytest.raises(DsecError):
        await attacker.files.remove(f"{dots}etc/hostname")        # sandbox user: not its file
    names = {e.name for e in await attacker.files.list(f"/work/{dots}")}
    assert ".dsec" in names, names                      # the sandbox's own /, not the host's
    assert host_canary.read_text().startswith("HOST-CANARY-")


async def test_file_api_symlinks_to_host_paths(attacker, host_canary):
    """Symlinks planted inside the sandbox (absolute, relative, via /proc/1/root) lead only into the sandbox, for the file API and for commands."""
    target = str(host_canary)
    r = await sh(attacker, f"ln -sf {target} /work/abs; ln -sf ../../../../../..{target} /work/rel; "
                           f"ln -sf /proc/1/root{target} /work/proc1; ln -sfn / /work/rootdir; "
                           f"cat /work/abs /work/rel /work/proc1 /work/rootdir{target} 2>&1", user=None)
    assert "HOST-CANARY" not in r.stdout, r
    for p in ("/work/abs", "/work/rel", "/work/proc1", f"/work/rootdir{target}"):
        try:
            data = await attacker.files.read(p)
        except DsecError:
            continue
        assert b"HOST-CANARY" not in data, p       # at most the sandbox's own file of that name
    # writing to a symlink replaces the link (atomic rename), never writes through it
    await attacker.files.write("/work/abs", b"through-the-link")
    r = await sh(attacker, "test -L /work/abs || echo regular-file", user=None)
    assert r.stdout == "regular-file\n"
    assert host_canary.read_text().startswith("HOST-CANARY-")


async def test_proc_1_root_and_proc_self_root_reach_only_the_sandbox(attacker, host_canary, server):
    """Reading host files through /proc/1/root, /proc/self/root and /proc/1/cwd (as root and as the user) finds nothing of the host."""
    paths = [f"/proc/{p}{host_canary}" for p in ("1/root", "self/root", "1/cwd", "self/cwd")]
    paths += [f"/proc/1/root{server.home}/admin.key", "/proc/1/root/../../../etc/shadow"]
    for user in ("root", None):
        out = await py(attacker, f"OUT.update({{p: read(p) for p in {paths!r}}})", user=user)
        leaked = {p: v for p, v in out.items() if v.startswith("ok:") and ("HOST-CANARY" in v or "dsk_" in v)}
        assert not leaked, leaked
        assert all(v in ("ENOENT", "EACCES") for p, v in out.items() if p.startswith("/proc/1/")), out
    for p in paths:
        try:
            data = await attacker.files.read(p)
        except DsecError:
            continue
        assert b"HOST-CANARY" not in data and b"dsk_" not in data, p


async def test_proc_environ_holds_no_platform_secrets(attacker, server):
    """Reading /proc/*/environ (as root) shows no platform secret (API key, DSEC_* settings, host paths), and other commands' environments are not readable at all."""
    out = await py(attacker, """
import glob
me = os.getpid()
for p in glob.glob("/proc/[0-9]*/environ"):
    pid = int(p.split("/")[2])
    OUT[str(pid)] = read(p)
OUT["me"] = me
OUT["mine"] = read("/proc/self/environ")
""")
    key = server.key
    blob = "\n".join(str(v) for v in out.values())
    assert key not in blob and "DSEC_" not in blob and str(server.home) not in blob
    assert out["mine"].startswith("ok:") and "PATH=" in out["mine"]
    # the agent (pid 1) and the other processes outside this command's Landlock domain: no access
    assert out["1"] == "EACCES", out["1"]


async def test_platform_state_and_logs_unreachable(attacker, server, host_canary):
    """Reading the platform's state from inside (DSEC_HOME: admin.key, server.log, edge.db, init.log; found via /proc/self/mountinfo) fails, and a recursive grep of / finds no API key."""
    home = server.home
    # the host path of DSEC_HOME leaks through mountinfo (see docs/security.md); make sure it is useless
    mi = (await sh(attacker, "cat /proc/self/mountinfo", user=None)).stdout
    assert str(home) in mi
    targets = [f"{home}/admin.key", f"{home}/server.log", f"{home}/edge.db", f"{home}/iam.db",
               f"{home}/sb/{attacker.id}/run/init.log", f"{home}/sb/{attacker.id}/config.json",
               "/proc/1/fd/1", "/proc/1/fd/2", "/proc/1/fd/3"]
    for user in ("root", None):
        out = await py(attacker, f"OUT.update({{p: read(p) for p in {targets!r}}})", user=user)
        assert all(not v.startswith("ok:") for v in out.values()), out
    for p in targets[:-3]:     # /proc/1/fd/* through the file API: see the magic-link test below
        with pytest.raises(DsecError, match="."):        # default-user sandbox: the file API neither
            data = await attacker.files.read(p)
            raise AssertionError(f"file API read {p}: {data[:200]!r}")
    # the key goes in on stdin, so it is in no file and no command line the grep could find
    r = await attacker.run("timeout 60 grep -r -s -l -F --exclude=pagemap -f /dev/stdin / ; echo rc=$?", user="root",
                           stdin=server.key + "\n", timeout_s=90)
    assert r.stdout.strip() in ("rc=1", "rc=2"), f"API key found in: {r.stdout}"


@pytest.mark.parametrize("user", [None, "root"], ids=["default-user", "root"])
async def test_file_api_does_not_follow_agent_magic_links(client, server, user):
    """The file API (served by the unconfined agent, PID 1) must not open host files through its own /proc/1/fd/* magic links: fds 1 and 2 are the host file <DSEC_HOME>/sb/<id>/run/init.log."""
    sb = await client.create_container(image="busybox", user=user)
    try:
        init_log = server.paths.sandboxes / sb.id / "run" / "init.log"
        secret = "HOST-INIT-LOG-" + secrets.token_hex(8)
        with open(init_log, "a") as f:
            f.write(secret + "\n")
        got = []
        for p in ("/proc/1/fd/1", "/proc/1/fd/2", "/proc/self/fd/2"):
            try:
                got.append((p, await sb.files.read(p)))
            except DsecError:
                pass
        leaked = [p for p, data in got if secret.encode() in data]
        assert not leaked, f"host file {init_log} read from inside through the file API at {leaked}"
    finally:
        await sb.stop()


async def test_neighbour_writable_layer_unreachable(attacker, neighbour, server):
    """Reaching the neighbour's writable layer (its upper dir by host path, /proc, a search of /) as root finds nothing, through commands and the file API."""
    upper = server.paths.sandboxes / neighbour.sb.id / "upper"
    paths = [f"{upper}/work/marker.txt", f"{upper}/work", f"/proc/1/root{upper}/work/marker.txt",
             f"{server.paths.sandboxes}/{neighbour.sb.id}/rootfs/work/marker.txt"]
    out = await py(attacker, f"OUT.update({{p: read(p) for p in {paths!r}}})")
    assert all(not v.startswith("ok:") for v in out.values()), out
    for p in paths:
        with pytest.raises(DsecError):
            await attacker.files.read(p)
    r = await attacker.run("timeout 60 grep -r -s -l -F --exclude=pagemap -f /dev/stdin / ; "
                           "find / -xdev -name marker.txt 2>/dev/null; echo done", user="root",
                           stdin=neighbour.marker + "\n", timeout_s=90)
    assert r.stdout.strip() == "done", f"neighbour's marker found in: {r.stdout}"


async def test_overwrite_bin_bash_stays_in_the_sandbox(client, cx, server):
    """Overwriting /bin/bash (as root, with a trojan) changes only that sandbox: another sandbox of the same image, a fresh one and the shared EROFS image keep the real bash; as the default user it is refused."""
    layers = {p: sha256(p) for p in server.paths.store.glob("*.erofs") if p.stat().st_size < 512 << 20}
    other = await cx.create_container(image="debian-python")
    victim = await client.create_container(image="debian-python", user="root")
    try:
        orig = (await sh(other, "sha256sum /usr/bin/bash")).stdout.split()[0]
        # the default (non-root) user cannot replace it at all
        r = await sh(other, "cp /bin/true /usr/bin/bash; echo rc=$?", user=None)
        assert "rc=1" in r.stdout and "Permission denied" in r.stderr, r
        r = await sh(victim, "printf '#!/bin/sh\\necho PWNED\\n' > /tmp/t; chmod 755 /tmp/t; mv -f /tmp/t /usr/bin/bash; "
                             "echo tampered >> /etc/passwd; "
                             "dd if=/dev/zero of=/usr/bin/env bs=1k count=1 conv=notrunc 2>/dev/null; echo done")
        assert "done" in r.stdout, r
        assert (await sh(victim, "echo hello")).stdout == "PWNED\n"   # its own commands now run the trojan
        fresh = await cx.create_container(image="debian-python")
        try:
            for sb in (other, fresh):
                r = await sh(sb, "sha256sum /usr/bin/bash; echo $BASH_VERSION")
                assert r.stdout.split()[0] == orig and r.stdout.split()[2].startswith("5."), r
        finally:
            await fresh.stop()
        assert {p: sha256(p) for p in layers} == layers, "a shared EROFS layer file changed"
    finally:
        await victim.stop()
        await other.stop()


async def test_recursive_grep_over_everything_incl_kpagecgroup(client):
    """A recursive grep over / (incl. /proc/kpagecgroup, /proc/kpageflags, /proc/kcore, /sys), as root, ends (no match, or OOM-killed inside its own memory cgroup) without hurting the kernel: the page-metadata files are masked (empty)."""
    sb = await client.create_container(image="debian-python", user="root")
    try:
        r = await sh(sb, "for f in /proc/kpagecgroup /proc/kpageflags /proc/kpagecount /proc/kcore /proc/kmsg; do "
                         "  test -e $f && echo \"$f $(head -c 64 $f 2>/dev/null | wc -c)\"; done; "
                         "timeout 30 grep -r -s -a zzzz-no-such-string / ; echo rc=$?", timeout_s=90)
        sizes = [line.split() for line in r.stdout.splitlines() if line.startswith("/proc/")]
        assert sizes and all(n == "0" for _, n in sizes), r.stdout
        # it ends: no match (1), unreadable files (2), or OOM-killed inside the sandbox's memory
        # cgroup (137: -a makes /proc/self/pagemap, 2^35 bytes without a newline, one line)
        assert any(f"rc={c}" in r.stdout for c in (1, 2, 137)), r
        assert (await sh(sb, "echo alive")).stdout == "alive\n"
    finally:
        await sb.stop()


PACK_RACE = r'''
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
host_dir, name = sys.argv[1], sys.argv[2]
SIZE = 64 << 20
os.makedirs("/work/b")
with open("/work/b/aaa_big", "wb") as f:          # copied first: its copy is the race window
    for _ in range(SIZE >> 20):
        f.write(b"\0" * (1 << 20))
    f.flush()
    os.fsync(f.fileno())
with open(f"/work/b/{name}", "w") as f:           # a decoy with the host file's name
    f.write("decoy\n")
os.symlink(host_dir, "/work/c")
fd = os.open("/work/b/aaa_big", os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
addr = libc.mmap(None, SIZE, 1, 1, fd, 0)        # PROT_READ, MAP_SHARED: the upper file's page cache
vec = (ctypes.c_ubyte * (SIZE // 4096))()
open("/work/ready", "w").close()
end = time.time() + 60
while time.time() < end:                          # side channel: the host starts reading aaa_big
    libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(SIZE), vec)
    if vec[len(vec) // 4] & 1:
        # RENAME_EXCHANGE: /work/b becomes the symlink to the host dir, /work/c the real dir
        print("swapped", libc.syscall(316, -100, b"/work/b", -100, b"/work/c", 2), flush=True)
        break
'''


@pytest.mark.skipif(not hasattr(Sandbox, "pack_diff"), reason="no pack_diff in this version")
async def test_pack_diff_symlink_race_does_not_copy_host_files(client, host_canary):
    """While pack_diff walks the sandbox's upper dir on the host, the sandbox swaps a directory for a symlink to a host directory (RENAME_EXCHANGE, timed by the page cache): no host file may end up in the new layer."""
    sb = await client.create_container(image="debian-python")
    name = f"cx-race-{secrets.token_hex(4)}@v1"
    try:
        await sb.files.write("/work/race.py", PACK_RACE)
        r = await sb.run(f"nohup python3 /work/race.py {host_canary.parent} {host_canary.name} >/work/race.log 2>&1 & "
                         "for i in $(seq 300); do test -e /work/ready && break; sleep 0.1; done; ls /work/ready",
                         timeout_s=60)
        assert r.exit_code == 0, r
        try:
            await sb.pack_diff(name)
        except DsecError:
            return                                 # refusing to pack is a safe answer too
    finally:
        await sb.stop()
    async with await client.create_container(image="debian-python", workspace=name, user="root") as sb2:
        r = await sb2.run("cat /work/b/* /work/c/* 2>/dev/null | grep -a -c HOST-CANARY")
        assert r.stdout.strip() == "0", "a host file was copied into the packed layer"
