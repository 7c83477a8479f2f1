"""The FnCall language table: how to compile and run code of each language, as data.

Adding a language is adding a row. A row is usable on an image when every binary in `needs`
exists there (the zygote reports which rows it can serve when it starts), so an image that
ships node or a JDK gets those languages without code changes.

Argument templates may use {src} (the source file), {exe} (the compiled program), {memory_mb}.
`run=None` means the Python zygote runs the code itself in a forked, pre-warmed interpreter.
"""

from __future__ import annotations

import re
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
    # the source file is named after the code's public class (Java: `public class FooTest` must be
    # in FooTest.java), `source` when there is none
    source_from_public_class: bool = False
    code_prefix: str | None = None                # prepended when the code lacks it (PHP's <?php tag)


EXE = "./main"
# the built-in pool image with every language below (dsec.images.builtin); fncall-python, the
# default, has python, bash, perl, c and cpp
POLYGLOT_IMAGE = "fncall-polyglot"
DEFAULT_IMAGE_LANGUAGES = frozenset({"python", "bash", "perl", "c", "cpp"})
# GO111MODULE=auto: a lone file builds without a go.mod (GOPATH mode), as SandboxFusion's does
GO_ENV = {"GOCACHE": "/tmp/go-cache", "GOPATH": "/tmp/go", "GOFLAGS": "-mod=mod", "GO111MODULE": "auto"}
JUNIT_LAUNCHER = "/usr/share/java/junit-platform-console-standalone.jar"
# transpile main.ts to main.js (no type check, like tsx); syntax errors fail with tsc's messages
TS_TRANSPILE = (
    "const ts=require('typescript'),fs=require('fs'),f=process.argv[1];"
    "const r=ts.transpileModule(fs.readFileSync(f,'utf8'),{fileName:f,reportDiagnostics:true,"
    "compilerOptions:{target:ts.ScriptTarget.ES2020,module:ts.ModuleKind.CommonJS}});"
    "const d=r.diagnostics||[];if(d.length){process.stderr.write(ts.formatDiagnostics(d,"
    "{getCanonicalFileName:x=>x,getCurrentDirectory:()=>'.',getNewLine:()=>'\\n'}));process.exit(1)}"
    "fs.writeFileSync('main.js',r.outputText)")

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
    # SandboxFusion runs TypeScript with tsx: transpiled, not type-checked. The same here with
    # TypeScript's own transpileModule (Debian's node-typescript): a syntax error fails the
    # compile step, a type error does not.
    Language("typescript", "main.ts", ("node", "--max-old-space-size={memory_mb}", "main.js"), "native",
             compile=("node", "-e", TS_TRANSPILE, "{src}"), needs=("node", "tsc"), aliases=("ts",),
             limit_address_space=False, artifacts=("main.js",)),
    Language("ruby", "main.rb", ("ruby", "{src}"), "script", needs=("ruby",)),
    Language("lua", "main.lua", ("lua5.4", "{src}"), "script", needs=("lua5.4",)),
    Language("php", "main.php", ("php", "-f", "{src}"), "script", needs=("php",), code_prefix="<?php"),
    Language("go", "main.go", (EXE,), "native", compile=("go", "build", "-o", "main", "{src}"),
             needs=("go",), aliases=("golang",), limit_address_space=False, min_processes=128, env=GO_ENV),
    # SandboxFusion's go_test: `go test FILE` on the code as a _test.go file
    Language("go_test", "main_test.go", ("go", "test", "{src}"), "native", needs=("go",),
             limit_address_space=False, min_processes=128, env=GO_ENV),
    Language("rust", "main.rs", (EXE,), "native", compile=("rustc", "-O", "-o", "main", "{src}"),
             needs=("rustc",), aliases=("rs",)),
    # -ea as SandboxFusion: graders' tests are Java `assert`s
    Language("java", "Main.java", ("java", "-Xmx{memory_mb}m", "-Xss64m", "-ea", "Main"), "native",
             compile=("javac", "-J-Xmx512m", "-encoding", "UTF-8", "{src}"), needs=("javac", "java"),
             limit_address_space=False, min_processes=256, artifacts=("*.class",)),
    # SandboxFusion's junit: the code is a JUnit 5 test class (file named after its public class,
    # see `source_from_public_class`), run by JUnit's console launcher (Debian's junit5).
    Language("junit", "Main.java", ("java", "-Xmx{memory_mb}m", "-ea", "-jar", JUNIT_LAUNCHER,
                                    "--class-path", ".", "--scan-class-path", "--disable-banner"), "native",
             compile=("javac", "-J-Xmx512m", "-encoding", "UTF-8", "-cp", JUNIT_LAUNCHER + ":.", "{src}"),
             needs=("javac", "java"), limit_address_space=False, min_processes=256,
             artifacts=("*.class",), source_from_public_class=True),
    # SandboxFusion's csharp is .NET (dotnet run); Debian ships Mono's C# 7 compiler: no top-level
    # statements, a `static void Main` is needed.
    Language("csharp", "main.cs", ("mono", "main.exe"), "native", compile=("mcs", "-out:main.exe", "{src}"),
             needs=("mcs", "mono"), aliases=("cs", "c#"), limit_address_space=False, artifacts=("main.exe",)),
    # SandboxFusion's pytest: the code is a test module, run by pytest (args: extra pytest arguments)
    Language("pytest", "test_main.py", ("python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "{src}"),
             "script", needs=("python3", "pytest-3")),
)

_PLACEHOLDER = re.compile(r"\{(src|exe|memory_mb)\}")
_PUBLIC_CLASS = re.compile(r"^\s*public\s+(?:final\s+|abstract\s+)*class\s+([A-Za-z_$][A-Za-z0-9_$]*)", re.M)

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


def image_for(name: str, default: str) -> str:
    """The pool image a SandboxFusion call (which names no image) of this language runs on."""
    return default if resolve(name).name in DEFAULT_IMAGE_LANGUAGES else POLYGLOT_IMAGE


def probes() -> dict[str, list[str]]:
    """What the zygote checks at start: language name -> binaries it needs."""
    return {lang.name: list(lang.needs) for lang in LANGUAGES}


def source_file(lang: Language, code: str) -> str:
    """The file the code is written to."""
    if lang.source_from_public_class:
        m = _PUBLIC_CLASS.search(code)
        if m:
            return m.group(1) + ".java"
    return lang.source


def expand(argv: tuple[str, ...], lang: Language, memory_mb: int, src: str | None = None) -> list[str]:
    values = {"src": src or lang.source, "exe": EXE, "memory_mb": str(memory_mb)}
    # only {name} placeholders are templates: code inside an argv (TS_TRANSPILE) keeps its braces
    return [_PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), a) for a in argv]
