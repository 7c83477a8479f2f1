"""The FnCall language table: how to compile and run code of each language, as data.

Adding a language is adding a row. A row is usable on an image when every binary in `needs`
exists there (the zygote reports which rows it can serve when it starts), so an image that
ships node or a JDK gets those languages without code changes.

Argument templates may use {src} (the source file), {exe} (the compiled program), {memory_mb}.
`run=None` means the Python zygote runs the code itself in a forked, pre-warmed interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsec.types import InvalidArgument


@dataclass(frozen=True)
class Language:
    name: str
    source: str                                   # file the code is written to (in a fresh work dir)
    run: tuple[str, ...] | None                   # argv; None: the zygote's warm Python interpreter
    family: str                                   # pool family: calls of one family share warm containers
    compile: tuple[str, ...] | None = None        # argv of the compile step, if any
    needs: tuple[str, ...] = ()                   # binaries the image must have
    aliases: tuple[str, ...] = ()
    # RLIMIT_AS caps the address space at memory_mb; runtimes that reserve huge virtual ranges
    # (JVM, V8, Go) get their own flag in the argv instead and the container's cgroup as backstop.
    limit_address_space: bool = True
    min_processes: int = 0                        # runtimes with many threads (JVM) need more
    compile_memory_mb: int = 2048                 # compilers need more than the program
    artifacts: tuple[str, ...] = ("main",)        # what the compile step makes (kept in the compile cache)
    env: dict[str, str] = field(default_factory=dict)


EXE = "./main"

LANGUAGES: tuple[Language, ...] = (
    Language("python", "main.py", None, "python", needs=("python3",), aliases=("python3", "py")),
    Language("bash", "main.sh", ("bash", "{src}"), "script", needs=("bash",), aliases=("sh", "shell")),
    Language("perl", "main.pl", ("perl", "{src}"), "script", needs=("perl",)),
    Language("c", "main.c", (EXE,), "native",
             compile=("gcc", "-O2", "-std=gnu17", "-o", "main", "{src}", "-lm"), needs=("gcc",)),
    Language("cpp", "main.cpp", (EXE,), "native",
             compile=("g++", "-O2", "-std=gnu++17", "-o", "main", "{src}"), needs=("g++",),
             aliases=("c++", "cxx")),
    Language("nodejs", "main.js", ("node", "--max-old-space-size={memory_mb}", "{src}"), "script",
             needs=("node",), aliases=("node", "js", "javascript"), limit_address_space=False),
    Language("ruby", "main.rb", ("ruby", "{src}"), "script", needs=("ruby",)),
    Language("lua", "main.lua", ("lua", "{src}"), "script", needs=("lua",)),
    Language("php", "main.php", ("php", "{src}"), "script", needs=("php",)),
    Language("go", "main.go", (EXE,), "native", compile=("go", "build", "-o", "main", "{src}"),
             needs=("go",), aliases=("golang",), limit_address_space=False, min_processes=128,
             env={"GOCACHE": "/tmp/go-cache", "GOPATH": "/tmp/go", "GOFLAGS": "-mod=mod"}),
    Language("rust", "main.rs", (EXE,), "native", compile=("rustc", "-O", "-o", "main", "{src}"),
             needs=("rustc",), aliases=("rs",)),
    Language("java", "Main.java", ("java", "-Xmx{memory_mb}m", "-Xss64m", "Main"), "native",
             compile=("javac", "-encoding", "UTF-8", "{src}"), needs=("javac", "java"),
             limit_address_space=False, min_processes=256, artifacts=("*.class",)),
)

_BY_NAME: dict[str, Language] = {}
for _lang in LANGUAGES:
    for _n in (_lang.name, *_lang.aliases):
        _BY_NAME[_n.lower()] = _lang


def resolve(name: str) -> Language:
    """The row for a language name or alias (case-insensitive); InvalidArgument otherwise."""
    lang = _BY_NAME.get(name.lower())
    if lang is None:
        raise InvalidArgument(f"unknown language {name!r}", field="language",
                              fix="use one of: " + ", ".join(lang.name for lang in LANGUAGES))
    return lang


def probes() -> dict[str, list[str]]:
    """What the zygote checks at start: language name -> binaries it needs."""
    return {lang.name: list(lang.needs) for lang in LANGUAGES}


def expand(argv: tuple[str, ...], lang: Language, memory_mb: int) -> list[str]:
    values = {"src": lang.source, "exe": EXE, "memory_mb": str(memory_mb)}
    return [a.format(**values) for a in argv]
