"""`dsec vm ...`: guest kernels, VM snapshots and bootable VM disks."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Optional

from rich.table import Table
import typer

from dsec.cli.common import _client, _run, _settings, console, err_console


# -- VM guest artefacts -------------------------------------------------------------------------
vm_app = typer.Typer(no_args_is_help=True, help="microVM / full-VM guest kernel and initramfs")


@vm_app.command("fetch-kernel")
def vm_fetch_kernel(
        initramfs: Annotated[bool, typer.Option(help="also build the guest initramfs")] = True) -> None:
    """Download and unpack the guest kernel (linux-image-cloud-amd64) into DSEC_HOME (cached)."""
    from dsec.backends.vm import guest
    paths = _settings().paths
    try:
        k = guest.ensure_kernel(paths)
        console.print(f"guest kernel {k.version}: {k.vmlinuz}")
        if initramfs:
            console.print(f"guest initramfs: {guest.build_initramfs(paths, k)}")
    except guest.GuestError as e:
        err_console.print(f"[red]error[/red]: {e}")
        raise typer.Exit(2)


vm_snapshot_app = typer.Typer(no_args_is_help=True, help="VM snapshots (dsec sandbox snapshot ID takes one)")
vm_app.add_typer(vm_snapshot_app, name="snapshot")


@vm_snapshot_app.command("ls")
def vm_snapshot_ls() -> None:
    """List the snapshots of your project and its sub-projects."""
    async def go() -> None:
        async with _client() as c:
            t = Table("id", "backend", "image", "project", "from sandbox", "MiB", "created")
            for s in await c.snapshots():
                t.add_row(s.id, s.backend, s.image, s.project, s.sandbox_id, f"{s.size_bytes / 2**20:.1f}",
                          s.created_at.isoformat(timespec="seconds"))
            console.print(t)
    _run(go())


@vm_snapshot_app.command("rm")
def vm_snapshot_rm(snapshot_ids: list[str]) -> None:
    """Delete snapshots (sandboxes restored from them keep running and can still be suspended)."""
    async def go() -> None:
        async with _client() as c:
            for sid in snapshot_ids:
                await c.delete_snapshot(sid)
                console.print(f"deleted {sid}")
    _run(go())


vm_disk_app = typer.Typer(no_args_is_help=True, help="bootable full-VM disks: an image's own kernel and init as qcow2")
vm_app.add_typer(vm_disk_app, name="disk")


@vm_disk_app.command("build")
def vm_disk_build(
        name: Annotated[str, typer.Argument(help="disk name (then VMArgs(image=IMAGE, disk=NAME))")],
        image: Annotated[str, typer.Option("--image", help="image with /boot/vmlinuz-* and systemd as /sbin/init")],
        size_mb: Annotated[Optional[int], typer.Option("--size-mb", help="filesystem size (default: 2x the files + 512 MiB, at least 1024)")] = None) -> None:
    """Build DSEC_HOME/vm/disks/NAME.qcow2 from IMAGE's layers, with the dsec agent as a systemd unit."""
    import time as _time

    from dsec.backends.vm import disks
    from dsec.types import DsecError
    t0 = _time.monotonic()
    try:
        d = disks.build(_settings().paths, name, image, size_mb=size_mb)
    except DsecError as e:
        err_console.print(f"[red]error[/red]: {e.message}" + (f" (field {e.field})" if e.field else "")
                          + (f"\n  fix: {e.fix}" if e.fix else ""))
        raise typer.Exit(2)
    console.print(f"vm disk {d.name}: image {d.image} ({d.image_digest[:19]}), kernel {d.kernel_version}, "
                  f"{d.size_mb} MiB, built in {_time.monotonic() - t0:.1f}s")


@vm_disk_app.command("ls")
def vm_disk_ls() -> None:
    """List the VM disks on this node."""
    from dsec.backends.vm import disks
    t = Table("name", "image", "digest", "kernel", "size MiB", "built")
    for d in disks.list_disks(_settings().paths):
        t.add_row(d.name, d.image, d.image_digest[:19], d.kernel_version, str(d.size_mb),
                  datetime.fromtimestamp(d.created_at, timezone.utc).isoformat(timespec="seconds"))
    console.print(t)


@vm_disk_app.command("rm")
def vm_disk_rm(name: Annotated[str, typer.Argument(help="disk name")]) -> None:
    """Remove a VM disk (VMs booted from it, running or suspended, and their snapshots keep their own link to it)."""
    from dsec.backends.vm import disks
    from dsec.types import DsecError
    try:
        disks.remove(_settings().paths, name)
    except DsecError as e:
        err_console.print(f"[red]error[/red]: {e.message}")
        raise typer.Exit(2)
    console.print(f"removed vm disk {name}")
