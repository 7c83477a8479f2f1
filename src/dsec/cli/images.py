"""`dsec image ...` and `dsec layer ...`: build, import, pull, list and remove images and named layers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

from rich.table import Table
import typer

from dsec.cli.common import _fail, _settings, console
from dsec.types import DsecError


image_app = typer.Typer(no_args_is_help=True, help="build, list and remove images")

# -- images ----------------------------------------------------------------------------------
def _images():
    from dsec.images.service import ImageService
    paths = _settings().paths
    paths.ensure()
    return ImageService(paths, settings=_settings().images)


@image_app.command("build")
def image_build(name: str,
                from_dir: Annotated[Optional[Path], typer.Option(help="a rootfs directory")] = None,
                from_tar: Annotated[Optional[Path], typer.Option(help="a rootfs tarball")] = None,
                debootstrap: Annotated[Optional[str], typer.Option(help="Debian suite, e.g. bookworm")] = None,
                include: Annotated[str, typer.Option(help="comma-separated packages for debootstrap")] = "",
                builtin: Annotated[bool, typer.Option(help="build the built-in image NAME (busybox, debian-python, fncall-python)")] = False,
                dockerfile: Annotated[Optional[Path], typer.Option(help="a build context dir with a Dockerfile (buildah; FROM names a dsec image)")] = None,
                file: Annotated[str, typer.Option(help="the Dockerfile's name inside --dockerfile")] = "Dockerfile",
                build_arg: Annotated[Optional[list[str]], typer.Option(help="KEY=VALUE for the Dockerfile's ARGs")] = None,
                network: Annotated[bool, typer.Option(help="let RUN steps use the host's network (default: none)")] = False,
                replace: bool = False) -> None:
    """Build an image (one EROFS layer) and register it under NAME."""
    from dsec.images.builtin import ensure_builtin
    svc = _images()
    sources = [x for x in (from_dir, from_tar, debootstrap, dockerfile) if x] + ([True] if builtin else [])
    if len(sources) != 1:
        _fail(DsecError("give exactly one source", field="source",
                        fix="use one of --from-dir, --from-tar, --debootstrap, --builtin, --dockerfile"))
    try:
        if dockerfile:
            from dsec.images.dockerfile import build_dockerfile, parse_build_args
            from dsec.images.progress import rich_progress
            with rich_progress(f"building {name}") as progress:
                info = build_dockerfile(svc, name, dockerfile, dockerfile=file, network=network, replace=replace,
                                        build_args=parse_build_args(build_arg or []), progress=progress).image
        elif builtin:
            info = ensure_builtin(svc, name)
        elif from_dir:
            info = svc.build_from_dir(name, from_dir, replace=replace)
        elif from_tar:
            info = svc.build_from_tar(name, from_tar, replace=replace)
        else:
            info = svc.build_debootstrap(name, suite=debootstrap, include=[p for p in include.split(",") if p],
                                         replace=replace)
    except DsecError as e:
        _fail(e)
    console.print(f"{info.name} {info.digest} {info.size_bytes / 1e6:.1f} MB")


@image_app.command("ls")
def image_ls() -> None:
    t = Table("name", "digest", "layers", "size MB", "created")
    for i in _images().list():
        t.add_row(i.name, i.digest[:19], str(len(i.layers)), f"{i.size_bytes / 1e6:.1f}", i.created_at.isoformat(timespec="seconds"))
    console.print(t)


@image_app.command("rm")
def image_rm(name: str) -> None:
    try:
        _images().remove(name)
    except DsecError as e:
        _fail(e)


@image_app.command("import")
def image_import(name: str,
                 oci: Annotated[Optional[Path], typer.Option(help="an OCI image layout directory")] = None,
                 docker_archive: Annotated[Optional[Path], typer.Option(help="a `docker save` tarball")] = None,
                 ref: Annotated[Optional[str], typer.Option(help="manifest ref name in the OCI index")] = None,
                 merge_mb: Annotated[int, typer.Option(help="merge consecutive OCI layers up to this size")] = 3072,
                 replace: bool = False) -> None:
    """Import an OCI / docker-archive image as EROFS layers (whiteouts kept)."""
    try:
        info = _images().import_oci(name, oci=oci, docker_archive=docker_archive, ref=ref,
                                    merge_bytes=merge_mb << 20, replace=replace)
    except DsecError as e:
        _fail(e)
    console.print(f"{info.name} {info.digest} {len(info.layers)} layer(s) {info.size_bytes / 1e6:.1f} MB")


@image_app.command("pull")
def image_pull(name: str,
               ref: Annotated[str, typer.Argument(help="docker://HOST[:PORT]/REPO[:TAG]")],
               tls_verify: Annotated[bool, typer.Option(help="require HTTPS with a valid certificate")] = True,
               creds: Annotated[Optional[str], typer.Option(help="USER:PASSWORD for the registry")] = None,
               merge_mb: Annotated[int, typer.Option(help="merge consecutive OCI layers up to this size")] = 3072,
               replace: bool = False) -> None:
    """Pull an image from a registry (through skopeo) and import it as EROFS layers."""
    try:
        info = _images().pull(name, ref, tls_verify=tls_verify, creds=creds,
                              merge_bytes=merge_mb << 20, replace=replace)
    except DsecError as e:
        _fail(e)
    console.print(f"{info.name} {info.digest} {len(info.layers)} layer(s) {info.size_bytes / 1e6:.1f} MB")


@image_app.command("gc")
def image_gc() -> None:
    """Delete layer files no image or layer references any more."""
    try:
        dead = _images().gc()
    except DsecError as e:
        _fail(e)
    console.print(f"deleted {len(dead)} layer file(s)")


@image_app.command("publish")
def image_publish(name: str) -> None:
    """Publish an image or layer of this node to the shared layer store (DSEC_LAYER_STORE);
    builds publish by themselves, this is for ones made before the store was set."""
    try:
        svc = _images()
        info = svc.publish(name)
    except DsecError as e:
        _fail(e)
    console.print(f"{info.name} {info.digest} published to {svc.shared.url if svc.shared else '?'}")


# -- named layers (workspaces, toolkits) -----------------------------------------------------
layer_app = typer.Typer(no_args_is_help=True, help="build, list, inspect and remove workspace/toolkit layers")


@layer_app.command("build")
def layer_build(name: Annotated[str, typer.Argument(help="NAME@VERSION, e.g. django-15388@v2")],
                from_dir: Annotated[Optional[Path], typer.Option(help="a directory (its tree is the layer)")] = None,
                from_tar: Annotated[Optional[Path], typer.Option(help="a tarball")] = None,
                from_git: Annotated[Optional[Path], typer.Option(help="a git checkout (git archive REV)")] = None,
                rev: str = "HEAD",
                prefix: Annotated[str, typer.Option(help="where git files land, e.g. work/repo")] = "",
                chown: Annotated[Optional[str], typer.Option(help="UID[:GID] for every entry")] = None,
                replace: bool = False) -> None:
    """Build a layer and register it as NAME@VERSION."""
    try:
        info = _images().build_layer(name, from_dir=from_dir, from_tar=from_tar, from_git=from_git,
                                     rev=rev, prefix=prefix, chown=chown, replace=replace)
    except DsecError as e:
        _fail(e)
    console.print(f"{info.name} {info.digest} {info.size_bytes / 1e6:.1f} MB")


@layer_app.command("ls")
def layer_ls() -> None:
    t = Table("name", "digest", "layers", "size MB", "created")
    for i in _images().list():
        if i.kind == "layer":
            t.add_row(i.name, i.digest[:19], str(len(i.layers)), f"{i.size_bytes / 1e6:.1f}",
                      i.created_at.isoformat(timespec="seconds"))
    console.print(t)


@layer_app.command("inspect")
def layer_inspect(name: str) -> None:
    try:
        info = _images().get(name, "name")
    except DsecError as e:
        _fail(e)
    print(info.model_dump_json(indent=2))


@layer_app.command("rm")
def layer_rm(name: str) -> None:
    try:
        _images().remove(name)
    except DsecError as e:
        _fail(e)
