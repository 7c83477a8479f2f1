"""The blocking SDK, generated from the async one (never a hand-written twin).

    from dsec import SyncClient, ContainerArgs
    with SyncClient() as c:
        sb = c.create_container(ContainerArgs(image="busybox"))
        print(sb.run("echo hi").stdout)
        for created in c.create_many(10, ContainerArgs(image="busybox")): ...
"""

from dsec.sdk._sync import synchronize
from dsec.sdk.client import Client, Created, Files, Sandbox

SyncFiles = synchronize(Files, name="SyncFiles")
SyncSandbox = synchronize(Sandbox, name="SyncSandbox")
SyncCreated = synchronize(Created, name="SyncCreated")
SyncClient = synchronize(Client, name="SyncClient")

__all__ = ["SyncClient", "SyncSandbox", "SyncFiles", "SyncCreated"]
