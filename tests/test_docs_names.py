"""The names the README and docs/ put in backticks exist in the code.

Every inline code span outside code blocks in ``README.md`` and ``docs/*.md`` is read;
what it names is checked against the repository (statically: source files are parsed,
not imported, so the engine plug-ins need no engine):

- a dotted name starting ``mori.`` is a module under ``src/mori`` or an attribute one
  defines (a class, function, constant, a class's field or method);
- a path under ``src/``, ``bench/``, ``tests/``, ``scripts/``, ``docs/``, ``examples/`` or
  ``.ci/`` exists (a glob matches something; ``FILE::name`` names a test in FILE), and a
  bare ``name.py`` is the name of some file in the repository;
- ``test_something`` is a test function under ``tests/``;
- ``mori COMMAND ...`` names a subcommand, and every ``--flag`` after it is one of that
  subcommand's (``mori.cli.main.build_parser``); ``python bench/X.py ...`` and
  ``python scripts/X.py ...``: the flags are that script's (its ``add_argument`` calls);
- a span that starts with ``--flag``: every flag in it is one of some ``mori``
  subcommand's, some bench or scripts tool's, or an engine's or agent CLI's flag the docs
  legitimately name (``EXTERNAL_FLAGS``, each with its reason);
- a name shaped like a policy's (``mori-ski``, ``lru-offload``, ``thunderagent+offload``),
  and each name a ``mori`` command's ``--policy`` takes, is a registered policy;
- a capitalised identifier (``ReturnCost``, ``PolicyConfig.fill_idle``, ``Status``) is a
  class or name defined in ``src/`` or ``bench/``, and ``Name.attr`` an attribute of that
  class (or of a project base class); else it is in ``EXTERNAL_NAMES``;
- an upper-case name with an underscore (``MODEL_VERSION``, ``MORI_API_KEYS``) occurs in
  the code (``src/``, ``bench/``, ``scripts/``, ``tests/``, ``.ci/``), else it is in
  ``EXTERNAL_CONSTANTS``.

All failures are reported at once, each as ``file:line: span: what is wrong``.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from test_docs_links import DOCS, ROOT, prose_lines

SRC = ROOT / "src"
CODE_DIRS = ("src", "bench", "tests", "scripts", ".ci")

# Flags of programs other than mori and its bench/scripts tools that the docs name on
# their own, each with the reason it is named.
_VLLM = "vLLM's own flag (docs/vllm-gpu.md, docs/vllm-sglang.md: how to start the engine)"
_SGLANG = "SGLang's own flag (docs/sglang-gpu.md, docs/vllm-sglang.md)"
_DOCKER = "docker run's flag (the GPU guides' container commands)"
_CLAUDE = "Claude Code's CLI flag (docs/agents.md: driving it through mori serve)"
_CODEX = "Codex CLI's flag (docs/agents.md)"
_PYTEST = "pytest's flag"
_DYNAMO = "NVIDIA Dynamo's own flag (docs/dynamo.md: the mocker's host tier, the frontend's router)"
_DYNAMO_TA = ("Dynamo's ThunderAgent router's flag (docs/dynamo.md: how the benchmark runs "
              "it, why it stalled)")
EXTERNAL_FLAGS: dict[str, str] = {
    "--additional-config": _VLLM,
    "--data-parallel-size": _VLLM,
    "--enable-prefix-caching": _VLLM,
    "--enable-prompt-tokens-details": _VLLM,
    "--kv-events-config": _VLLM,
    "--num-host-blocks": _DYNAMO,
    "--router-mode": _DYNAMO,
    "--pause-threshold": _DYNAMO_TA,
    "--resume-hysteresis": _DYNAMO_TA,
    "--resume-timeout-seconds": _DYNAMO_TA,
    "--scheduler-interval-seconds": _DYNAMO_TA,
    "--kv-offloading-backend": _VLLM,
    "--kv-offloading-size": _VLLM,
    "--kv-transfer-config": _VLLM,
    "--num-gpu-blocks-override": _VLLM,
    "--scheduler-cls": _VLLM,
    "--scheduling-policy": _VLLM,
    "--tensor-parallel-size": _VLLM,
    "--enable-metrics": _SGLANG,
    "--enable-priority-scheduling": _SGLANG,
    "--hicache-ratio": _SGLANG,
    "--radix-cache-backend": _SGLANG,
    "--radix-eviction-policy": _SGLANG,
    "--schedule-low-priority-values-first": _SGLANG,
    "--tp-size": _SGLANG,
    "--device": _SGLANG,
    "--ipc": _DOCKER,
    "--shm-size": _DOCKER,
    "--allowedTools": _CLAUDE,
    "--dangerously-skip-permissions": _CLAUDE,
    "--permission-mode": _CLAUDE,
    "--resume": _CLAUDE,
    "--session-id": _CLAUDE,
    "--skip-git-repo-check": _CODEX,
    "--autocompact": _CLAUDE,
    "--strict-config": _CODEX,
    "--exit-immediately": "mini-swe-agent's flag (docs/agents.md)",
    "--router": "ThunderAgent's launcher's flag (docs/benchmarks.md: the bench's arm b)",
    "--help": "every command's",
    "--strict-markers": _PYTEST,
}

# Capitalised names the docs use that are not the project's, by where they come from.
_VLLM_NAMES = {
    "AllBlocksCleared", "AsyncEngineArgs", "AsyncLLM", "AsyncScheduler", "BlockHashes",
    "BlockPool", "BlockRemoved", "BlockStored", "FreeKVCacheBlockQueue", "ModelRunnerOutput",
    "OffloadingConnector", "OffloadingSpec", "OffloadingSpecFactory", "OffloadingWorker",
    "Request", "Scheduler", "SchedulerConfig", "TieringOffloadingSpec", "KVCacheBlock",
    "DevicePointers", "GPULoadStoreSpec", "LRUCachePolicy", "CPUOffloadingManager",
    "KvHintsEnvelope",
}
_SGLANG_NAMES = {
    "CachePolicy", "CachePolicyFactory", "EvictionStrategy", "Req", "ReqContext",
    "ServerArgs", "UnifiedRadixCache", "UnifiedTreeCore", "KVEventsConfig",
}
_AGENT_NAMES = {  # Claude Code's tools and content kinds, as its transcripts name them
    "Agent", "AskUserQuestion", "Bash", "Edit", "ListAgents", "Read", "ReportFindings",
    "ScheduleWakeup", "Skill", "SubagentSpawn", "Task", "ToolSearch", "Workflow", "Write",
    "DeferredToolPlaceholder",
}
_PYTHON_NAMES = {"None", "TypeError", "ClientOSError", "ServerDisconnectedError",
                 "VmHWM"}  # Python, aiohttp's errors, /proc/PID/status's field
_DYNAMO_NAMES = {"KvRouter"}  # NVIDIA Dynamo's router client (docs/dynamo.md)
_HTTP_NAMES = {"Allow", "Origin", "Host"}  # headers
_WORDS = {"PCIe"}  # the bus, written as its name is
EXTERNAL_NAMES = (_VLLM_NAMES | _SGLANG_NAMES | _AGENT_NAMES | _PYTHON_NAMES | _HTTP_NAMES
                  | _DYNAMO_NAMES | _WORDS)

# Dotted names starting ``mori.`` that name fields on the wire, not code.
WIRE_FIELDS = {
    "mori.prompt_tokens": "a request body's field (docs/gateway.md: the prompt size)",
    "mori.program": "the key of MORI's action in vLLM's kv_hints (docs/vllm-gpu.md)",
}

# Upper-case names that belong to other programs: the agent CLIs' environment
# variables, and the operating system's flags.
EXTERNAL_CONSTANTS = {
    "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL", "CLAUDE_CODE_AUTO_COMPACT_WINDOW",
    "CLAUDE_CODE_MAX_CONTEXT_TOKENS", "CLAUDE_CONFIG_DIR", "CODEX_HOME",
    "GOOGLE_GEMINI_BASE_URL", "SGLANG_PLUGINS", "O_DIRECT", "TCP_NODELAY",
}

_SPAN = re.compile(r"(`+)(.+?)\1")
_MORI_NAME = re.compile(r"(?<![\w./-])mori(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w./-])(?:src|bench|tests|scripts|docs|examples|\.ci)/[^\s`'\"(),;\]]*")
_PY_FILE = re.compile(r"^([\w-]+\.(?:py|sh))(?:::(\w+))?$")
_TEST_NAME = re.compile(r"^test_\w+$")
_FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
_CAPITAL = re.compile(r"^([A-Z]\w*[a-z]\w*)(?:\.(\w+))?(?:\(.*)?$")
_POLICY_NAME = re.compile(r"^(?:mori|lru|smg|thunderagent)(?:[-+][a-z0-9]+)+$")
_POLICY_FLAG = re.compile(r"--polic(?:y|ies)[= ]([\w+,-]+)")
# Names shaped like a policy's that are something else.
NOT_POLICIES = {
    "mori-test": "a model name the agent CLIs were given (docs/agents-wire.md)",
    "mori-trace": "the canonical trace file's format name (docs/traces.md)",
}
_CONSTANT = re.compile(r"^[A-Z][A-Z0-9]*_[A-Z0-9_]+$")


@dataclass
class Span:
    path: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: `{self.text}`"


def spans() -> Iterator[Span]:
    for doc in DOCS:
        for n, line in prose_lines(doc.read_text()):
            for m in _SPAN.finditer(line):
                yield Span(doc, n, m.group(2).strip())


# -- what the code defines -------------------------------------------------------------


@dataclass
class ClassInfo:
    members: set[str] = field(default_factory=set)
    bases: set[str] = field(default_factory=set)  # the bases' names, as written


@dataclass
class Definitions:
    names: set[str] = field(default_factory=set)  # classes and module-level names
    classes: dict[str, ClassInfo] = field(default_factory=dict)  # merged by name


def _targets(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    if isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING, optional imports
        inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
        for h in getattr(node, "handlers", []):
            inner += h.body
        return [n for s in inner for n in _targets(s)]
    return []


def _class_info(node: ast.ClassDef) -> ClassInfo:
    info = ClassInfo(bases={ast.unparse(b).split(".")[-1].split("[")[0] for b in node.bases})
    for s in node.body:
        info.members.update(_targets(s))
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == "__init__":
            for n in ast.walk(s):  # self.x = ... in __init__
                if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                        and n.value.id == "self" and isinstance(n.ctx, ast.Store)):
                    info.members.add(n.attr)
    return info


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@cache
def definitions() -> Definitions:
    d = Definitions()
    for top in ("src", "bench"):
        for py in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(parsed(py)):
                if isinstance(node, ast.ClassDef):
                    d.names.add(node.name)
                    info = _class_info(node)
                    have = d.classes.setdefault(node.name, ClassInfo())
                    have.members |= info.members
                    have.bases |= info.bases
            for s in parsed(py).body:
                d.names.update(_targets(s))
    return d


def class_has(name: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether project class ``name`` (or a base) has ``attr``; True where a base is not
    the project's (its attributes are not known here)."""
    info = definitions().classes.get(name)
    if info is None or name in seen:
        return True
    if attr in info.members:
        return True
    return any(class_has(b, attr, seen | {name}) for b in info.bases
               if b not in ("object", "Generic", "Protocol"))


def resolve_mori(dotted: str) -> str | None:
    """Why ``mori.x.y`` names nothing, or None where it names a module or attribute."""
    parts = dotted.split(".")
    base = SRC
    i = 0
    module: Path | None = None
    found_pkg = False
    while i < len(parts):
        pkg, mod = base / parts[i], base / f"{parts[i]}.py"
        if pkg.is_dir():  # a package, or a namespace package (src/mori/gateway)
            init = pkg / "__init__.py"
            base, module, i = pkg, (init if init.exists() else None), i + 1
            found_pkg = True
        elif mod.exists():
            module, i = mod, i + 1
            break
        else:
            break
    rest = parts[i:]
    if not rest and (module is not None or found_pkg):
        return None
    if module is None:
        return "no such module under src/"
    tree = parsed(module)
    top = {n: s for s in tree.body for n in _targets(s)}
    if rest[0] not in top:
        return f"{module.relative_to(ROOT)} defines no {rest[0]!r}"
    node = top[rest[0]]
    for attr in rest[1:]:
        if not isinstance(node, ast.ClassDef):
            return None  # an import or a value: what it holds is not followed
        if not class_has(node.name, attr):
            return f"{node.name} has no attribute {attr!r}"
        node = next((s for s in node.body if attr in _targets(s)), node)
    return None


# -- flags -----------------------------------------------------------------------------


@cache
def mori_commands() -> dict[tuple[str, ...], set[str]]:
    """Each ``mori`` (sub)command's words, with the flags it takes."""
    from mori.cli.main import build_parser

    out: dict[tuple[str, ...], set[str]] = {}

    def walk(p: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        out[words] = {s for s in p._option_string_actions if s.startswith("--")}
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, (*words, name))

    walk(build_parser(), ())
    return out


@cache
def script_flags(path: Path) -> frozenset[str]:
    """The flags a bench or scripts tool's ``add_argument`` calls define."""
    flags: set[str] = set()
    for n in ast.walk(parsed(path)):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "add_argument"):
            names = [a.value for a in n.args
                     if isinstance(a, ast.Constant) and isinstance(a.value, str)
                     and a.value.startswith("--")]
            flags.update(names)
            if any(k.arg == "action" and "BooleanOptional" in ast.unparse(k.value)
                   for k in n.keywords):
                flags.update("--no-" + f[2:] for f in names)
    return frozenset(flags)


@cache
def all_flags() -> frozenset[str]:
    flags = set(EXTERNAL_FLAGS)
    for f in mori_commands().values():
        flags |= f
    for top in ("bench", "scripts"):
        for py in (ROOT / top).glob("*.py"):
            flags |= script_flags(py)
    return frozenset(flags)


def check_flags(text: str, allowed: set[str] | frozenset[str], who: str) -> list[str]:
    return [f"{f} is not a flag of {who}" for f in _FLAG.findall(text) if f not in allowed]


def check_command(text: str) -> list[str]:
    words = text.split()
    if words[:3] == ["python", "-m", "mori"]:
        words = ["mori", *words[3:]]
    if words[0] == "mori" and len(words) > 1 and re.fullmatch(r"[a-z][a-z-]*", words[1]):
        commands = mori_commands()
        path: tuple[str, ...] = ()
        for w in words[1:]:
            if (*path, w) not in commands:
                break
            path = (*path, w)
        if not path:
            return [f"mori has no subcommand {words[1]!r}"]
        rest = " ".join(words[1 + len(path):])
        return check_flags(rest, commands[path], "mori " + " ".join(path))
    if words[0] == "python" and len(words) > 1 and re.fullmatch(
            r"(bench|scripts)/\w+\.py", words[1]):
        script = ROOT / words[1]
        if script.exists():
            return check_flags(" ".join(words[2:]), script_flags(script), words[1])
    return []


@cache
def policies() -> frozenset[str]:
    from mori.core.policies import POLICIES

    return frozenset(POLICIES.names())


def check_policies(text: str) -> list[str]:
    names: list[str] = []
    if _POLICY_NAME.match(text) and text not in NOT_POLICIES:
        names.append(text)
    for m in _POLICY_FLAG.finditer(text):
        names += [n for n in m.group(1).split(",") if re.fullmatch(r"[a-z][\w+-]{2,}", n)]
    return [f"{n} is not a registered policy (mori policies)" for n in names
            if n not in policies()]


# -- the other kinds -------------------------------------------------------------------


@cache
def repo_files() -> frozenset[str]:
    names: set[str] = set()
    for top in (*CODE_DIRS, "docs", "examples"):
        names.update(p.name for p in (ROOT / top).rglob("*") if p.is_file())
    return frozenset(names)


@cache
def known_tests() -> frozenset[str]:
    names: set[str] = set()
    for py in (ROOT / "tests").rglob("*.py"):
        names.update(re.findall(r"^\s*(?:async )?def (test_\w+)", py.read_text(), re.M))
    return frozenset(names)


@cache
def code_text() -> str:
    parts = []
    for top in CODE_DIRS:
        for p in (ROOT / top).rglob("*"):
            if p.is_file() and p.suffix in (".py", ".sh", "") and "__pycache__" not in p.parts:
                parts.append(p.read_text(errors="replace"))
    return "\n".join(parts)


def check_path(token: str) -> str | None:
    token = token.rstrip(".:")
    token, _, test = token.partition("::")
    token = re.sub(r":\d+(-\d+)?$", "", token)  # file:LINE
    if any(c in token for c in "*?["):
        return None if list(ROOT.glob(token)) else "no file matches"
    target = ROOT / token
    if not target.exists():
        return "no such file or folder"
    if test and not re.search(rf"def {re.escape(test)}\b", target.read_text()):
        return f"{token} has no {test}"
    return None


def check_span(text: str) -> list[str]:
    problems: list[str] = []
    for name in _MORI_NAME.findall(text):
        why = None if name in WIRE_FIELDS else resolve_mori(name)
        if why:
            problems.append(f"{name}: {why}")
    for token in _PATH.findall(text):
        if re.search(r"[A-Z]{2,}|<|\{", token.split("/")[-1]):
            continue  # a placeholder: bench/X.py, docs/FILE.md
        why = check_path(token)
        if why:
            problems.append(f"{token}: {why}")
    m = _PY_FILE.match(text)
    if m and m.group(1) not in repo_files():
        problems.append(f"no file named {m.group(1)} in the repository")
    if m and m.group(2) and m.group(2) not in known_tests():
        problems.append(f"no test named {m.group(2)}")
    if _TEST_NAME.match(text) and text not in known_tests():
        problems.append("no test function of this name under tests/")
    problems += check_policies(text)
    if text.startswith(("mori ", "python ")):
        problems += check_command(text)
    elif text.startswith("--"):
        problems += check_flags(text, all_flags(),
                                "any mori command, bench or scripts tool, or EXTERNAL_FLAGS")
    m = _CAPITAL.match(text)
    if m and m.group(1) not in EXTERNAL_NAMES:
        name, attr = m.group(1), m.group(2)
        if name not in definitions().names:
            problems.append(f"{name} is defined nowhere in src/ or bench/ "
                            "(nor in EXTERNAL_NAMES)")
        elif attr and name in definitions().classes and not class_has(name, attr):
            problems.append(f"{name} has no attribute {attr!r}")
    if (_CONSTANT.match(text) and text not in EXTERNAL_CONSTANTS
            and not re.search(rf"\b{text}\b", code_text())):
        problems.append(f"{text} occurs nowhere in the code (nor in EXTERNAL_CONSTANTS)")
    return problems


def test_names_in_the_docs_exist() -> None:
    failures = [f"{s.where()}: {why}" for s in spans() for why in check_span(s.text)]
    assert not failures, f"{len(failures)} names in the docs name nothing:\n" + "\n".join(
        failures)


def test_the_checks_catch_what_they_should() -> None:
    """Each kind of check, on a name that exists and on one that does not."""
    assert not check_span("mori.core.policy.PolicyConfig")
    assert check_span("mori.core.policy.NoSuchThing")
    assert check_span("mori.no_such_module")
    assert not check_span("mori simulate --fill-idle")
    assert check_span("mori simulate --no-such-flag")
    assert check_span("mori no-such-command")
    assert not check_span("src/mori/cli/main.py")
    assert check_span("src/mori/no_such.py")
    assert not check_span("ReturnCost")
    assert check_span("NoSuchClassAnywhere")
    assert check_span("ReturnCost.no_such_attr")
    assert not check_span("--reload-gbps")
    assert check_span("--no-such-flag-anywhere")
    assert check_span("test_no_such_test_anywhere")
    assert not check_span("mori-ski")
    assert check_span("mori-no-such-policy")
    assert check_span("mori simulate --policy mori,no-such-policy")
