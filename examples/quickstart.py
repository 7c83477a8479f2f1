"""A live sandbox doing something real, on the embedded default (run by scripts/install.sh)."""

import asyncio

from dsec import Client, ContainerArgs


async def main() -> None:
    async with Client() as c:
        sb = await c.create_container(ContainerArgs(image="debian-python", cpu_cores=1, memory_mb=512,
                                                    ttl_idle_s=300))
        print("created", sb.id)
        try:
            r = await sb.run("python3 -c 'print(6*7)'")
            print("python says", r.stdout.strip(), "exit", r.exit_code)
            assert r.stdout == "42\n" and r.exit_code == 0

            await sb.run("cd /tmp && export X=1", session="s1")
            r = await sb.run("pwd; echo $X", session="s1")
            print("session keeps state:", r.stdout.split())
            assert r.stdout.split() == ["/tmp", "1"]

            print("streaming:", end=" ", flush=True)
            async for ev in sb.stream("for i in 1 2 3; do echo $i; sleep 0.3; done"):
                if ev.type == "stdout":
                    print(ev.data.strip(), end=" ", flush=True)
            print()

            await sb.files.write("/work/a.txt", b"hi")
            assert await sb.files.read("/work/a.txt") == b"hi"
            code = "import sys, platform; print(platform.python_version(), sys.platform)"
            await sb.files.write("/work/hello.py", code)
            r = await sb.run("python3 hello.py", check=True)
            print("file round trip ok; python", r.stdout.strip())
        finally:
            await sb.stop()
            print("stopped", sb.id)


if __name__ == "__main__":
    asyncio.run(main())
