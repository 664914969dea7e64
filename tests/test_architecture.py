"""The layout's rules, read off the source (AST), so that a change that breaks one fails here:

- the core (ops, backends, kernels, model, families, heads, loading, optimize, config, numerics, files, cuda_graphs)
  imports no application and not `fastbert.common`; `fastbert.common` imports no application; an application
  imports the core, `fastbert.common`, itself and the applications `APPLICATION_USES` names for it (the CLI runs
  every application; the server serves the embedding pipeline's `Embedder` and batching rather than a second copy);
- no module imports an underscore name of another of the project's modules (the compiled extension `fastbert._C`
  is the one exception: torch's naming convention for it);
- no test module imports another test module (shared helpers live in `tests/helpers.py`);
- no function of the core is longer than `MAX_CORE_FUNCTION_LINES`, except `@triton.jit` kernels (one kernel is one
  GPU program: splitting it means more launches or `tl.inline` helpers that hide the pointer arithmetic).

Each rule is also run on a planted violation, so that the check itself is known to fail when it should.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APPLICATIONS = ("cli", "embedding", "training", "bench", "serving")
# application -> the other applications it builds on; None: any (the CLI is the front of all of them)
APPLICATION_USES: dict[str, set[str] | None] = {"cli": None, "serving": {"embedding"}}
MAX_CORE_FUNCTION_LINES = 60
PRIVATE_EXCEPTIONS = {("fastbert", "_C")}
OWN_TOP_LEVEL = ("fastbert", "kernels", "tools", "tests", "benchmarks")


def module_name(path: Path) -> str:
    """The dotted name a file is imported under (kernels/ is installed as fastbert.kernels)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kernels":
        parts = ["fastbert", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_files() -> list[Path]:
    return sorted([*ROOT.glob("fastbert/**/*.py"), *ROOT.glob("kernels/**/*.py")])


def project_files() -> list[Path]:
    files = package_files()
    for folder in ("tools", "tests", "benchmarks"):
        files += sorted((ROOT / folder).glob("**/*.py"))
    return files


def room(module: str) -> str:
    """'core', 'common' or the application's name, for a module of the fastbert package."""
    parts = module.split(".")
    if module == "fastbert.__main__":  # `python -m fastbert`: the CLI's entry point
        return "cli"
    if len(parts) > 1 and parts[1] == "common":
        return "common"
    if len(parts) > 1 and parts[1] in APPLICATIONS:
        return parts[1]
    return "core"


def resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def imported_names(module: str, source: str, is_package: bool = False) -> list[tuple[str, str | None, int]]:
    """(module imported from, name imported or None, line) for every import in ``source``, at any depth, and every
    `importlib.import_module("...")` with a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                origin = resolve_relative(module, is_package, node.level, node.module)
            found += [(origin, alias.name, node.lineno) for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.args[0].value, None, node.lineno))
    return found


def targets(origin: str, name: str | None) -> list[str]:
    """The fastbert modules an import may load: the module itself, and origin.name when that is a submodule."""
    full = [origin] + ([f"{origin}.{name}"] if name else [])
    return [m if not m.startswith("kernels") else "fastbert." + m for m in full if m.split(".")[0] == "fastbert"]


def application_may_use(application: str, other: str) -> bool:
    uses = APPLICATION_USES.get(application, set())
    return other in ("core", "common", application) or uses is None or other in uses


def direction_violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """Imports of ``module`` that go against the layout's direction."""
    own = room(module)
    allowed = {"core"} if own == "core" else {"core", "common"} if own == "common" else None
    problems = []
    for origin, name, line in imported_names(module, source, is_package):
        for target in targets(origin, name):
            if target.split(".")[:2] == ["fastbert", "_C"]:
                continue
            other = room(target)
            if allowed is not None and other not in allowed:
                problems.append(f"{module}:{line} ({own}) imports {target} ({other})")
            elif allowed is None and not application_may_use(own, other):
                problems.append(f"{module}:{line} (application {own}) imports application {target}")
    return problems


def private_violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """`from X import _name` (or `import X._name`) where X is one of the project's own modules."""
    problems = []
    for origin, name, line in imported_names(module, source, is_package):
        if origin.split(".")[0] not in OWN_TOP_LEVEL or origin == "__future__":
            continue
        parts = origin.split(".") + ([name] if name else [])
        for parent, part in zip(parts, parts[1:], strict=False):
            if part.startswith("_") and not part.startswith("__") and (parent, part) not in PRIVATE_EXCEPTIONS:
                problems.append(f"{module}:{line} imports the private {part} from {origin}")
                break
    return problems


def imports_of_test_modules(module: str, source: str, is_package: bool = False) -> list[str]:
    """Imports of a test module (``test_*``) by another module."""
    return [f"{module}:{line} imports the test module {target}"
            for origin, name, line in imported_names(module, source, is_package)
            for target in [origin] + ([f"{origin}.{name}"] if name else [])
            if target.split(".")[0] == "tests" and target.split(".")[-1].startswith("test_")]


def is_triton_kernel(node: ast.AST) -> bool:
    return any("jit" in ast.unparse(decorator) and "triton" in ast.unparse(decorator)
               for decorator in getattr(node, "decorator_list", []))


def long_functions(module: str, source: str, limit: int = MAX_CORE_FUNCTION_LINES) -> list[str]:
    """Functions of ``source`` longer than ``limit`` lines (docstring excluded), Triton kernels left out."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or is_triton_kernel(node):
            continue
        body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
        length = node.end_lineno - body[0].lineno + 1
        if length > limit:
            problems.append(f"{module}.{node.name}:{node.lineno} has {length} lines")
    return problems


def each_file(files: list[Path]):
    for path in files:
        yield module_name(path), path.read_text(encoding="utf-8"), path.name == "__init__.py"


def test_the_core_imports_no_application_and_applications_only_the_core_and_common():
    problems = [p for module, source, pkg in each_file(package_files())
                for p in direction_violations(module, source, pkg)]
    assert not problems, "\n".join(problems)


def test_no_module_imports_a_private_name_of_another():
    problems = [p for module, source, pkg in each_file(project_files())
                for p in private_violations(module, source, pkg)]
    assert not problems, "\n".join(problems)


def test_no_test_module_imports_another():
    files = sorted((ROOT / "tests").glob("**/*.py")) + sorted((ROOT / "benchmarks").glob("**/*.py"))
    problems = [p for module, source, pkg in each_file(files) for p in imports_of_test_modules(module, source, pkg)]
    assert not problems, "\n".join(problems)


def test_a_planted_test_module_import_is_found():
    assert imports_of_test_modules("tests.ops.test_attention", "from tests.ops import test_attention_window\n")
    assert imports_of_test_modules("tests.test_model", "from tests.backends.test_dispatch import check\n")
    assert not imports_of_test_modules("tests.test_model", "from tests.helpers import tiny_model\n")


def test_no_core_function_is_longer_than_the_limit():
    core = [path for path in package_files() if room(module_name(path)) == "core"]
    problems = [p for module, source, _ in each_file(core) for p in long_functions(module, source)]
    assert not problems, "\n".join(problems)


def test_the_rooms_cover_the_package():
    rooms = {room(module_name(path)) for path in package_files()}
    assert {"core", "common", "cli", "embedding", "training", "bench"} <= rooms


@pytest.mark.parametrize(("module", "source"), [
    ("fastbert.model", "from fastbert.cli import main\n"),
    ("fastbert.ops.attention", "def f():\n    import fastbert.training.loop\n"),
    ("fastbert.kernels.gemm", "from fastbert import embedding\n"),
    ("fastbert.backends", "import importlib\nimportlib.import_module('fastbert.bench.e2e')\n"),
    ("fastbert.common.text", "from fastbert.training import corpus\n"),
    ("fastbert.embedding.reading", "from fastbert.training.corpus import cpython_sentences\n"),
    ("fastbert.optimize", "from fastbert.common.resolve import UserError\n"),
    ("fastbert.serving.app", "from fastbert.training import loop\n"),
])
def test_a_planted_import_against_the_direction_is_found(module, source):
    assert direction_violations(module, source)


@pytest.mark.parametrize(("module", "source"), [
    ("fastbert.model", "from fastbert.ops import spec\n"),
    ("fastbert.cli.embed", "from fastbert import embedding, training\n"),
    ("fastbert.training.loop", "from fastbert.files import write_atomic\nfrom fastbert.common import resolve\n"),
    ("fastbert.backends.cpp", "from fastbert import _C\n"),
    ("fastbert.serving.engines", "from fastbert.embedding import Embedder\n"),
])
def test_imports_along_the_direction_pass(module, source):
    assert direction_violations(module, source) == []


@pytest.mark.parametrize(("module", "source", "is_package"), [
    ("fastbert.training.pretrain", "from fastbert.training.corpus import _docstrings\n", False),
    ("tests.training.test_finetune", "from tests.helpers import _inputs\n", False),
    ("fastbert.kernels.attention", "from . import _gemm\n", False),
    ("fastbert.kernels", "from ._common import INTERPRETER\n", True),
    ("benchmarks.gpu_check", "def f():\n    from fastbert.backends import _load\n", False),
])
def test_a_planted_private_import_is_found(module, source, is_package):
    assert private_violations(module, source, is_package)


def test_public_and_third_party_imports_pass():
    source = "from fastbert import _C\nfrom torch._dynamo import config\nfrom fastbert.files import write_atomic\n"
    assert private_violations("fastbert.backends.cpp", source) == []


def test_a_planted_long_function_is_found_and_a_triton_kernel_is_not():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CORE_FUNCTION_LINES + 1))
    assert long_functions("fastbert.model", f"def f():\n    '''doc'''\n{body}")
    assert not long_functions("fastbert.model", f"def f():\n    '''doc'''\n{body[: -len('    x60 = 60')-1]}")
    assert not long_functions("fastbert.kernels.gemm", f"@triton.jit\ndef kernel():\n{body}")
