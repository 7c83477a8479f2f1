"""VM sandboxes on the embedded default: a microVM clone, a snapshot restored as a new VM, a VM
parked on disk and resumed by its next request (docs/vm.md). Run after scripts/install.sh."""

import asyncio
import time

from dsec import Client, MicroVMArgs


async def main() -> None:
    async with Client() as c:
        t0 = time.monotonic()
        vm = await c.create_microvm(MicroVMArgs(image="debian-python", memory_mb=512))
        print(f"microvm {vm.id} ready in {time.monotonic() - t0:.2f}s on {vm.info.accel} "
              "(the first one of an image also builds its template)")
        try:
            r = await vm.run("python3 -c 'import platform; print(platform.release())'")
            print("guest kernel:", r.stdout.strip())
            await vm.files.write("/work/state.txt", "saved before the snapshot")

            snap = await vm.snapshot()
            print(f"snapshot {snap.id}: {snap.size_bytes / 2**20:.0f} MiB")
            twin = await c.create_microvm(image="debian-python", snapshot=snap.id)
            print("restored as", twin.id, "->", await twin.files.read_text("/work/state.txt"))
            await twin.stop()

            await vm.suspend()
            print("parked on disk:", (await vm.refresh()).state.value)
            r = await vm.run("echo resumed by this request")
            print(r.stdout.strip(), "| host memory now", (await vm.refresh()).host_pss_mb, "MiB")
        finally:
            await vm.stop()


if __name__ == "__main__":
    asyncio.run(main())
