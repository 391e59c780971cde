"""The structure the design doc describes, checked: shared/ at the bottom, extract/train/eval
beside each other with no import between them, and one module that names the store's arrays."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("extract", "regenerate", "train", "eval")


def modules(pkg: str):
    for f in sorted((REPO / pkg).rglob("*.py")):
        yield f, ast.parse(f.read_text())


def imported_packages(tree) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_stages_import_shared_and_never_each_other():
    for pkg in ("shared", *STAGES):
        for f, tree in modules(pkg):
            ours = imported_packages(tree) & {"shared", *STAGES}
            allowed = {"shared"} if pkg == "shared" else {"shared", pkg}
            assert ours <= allowed, f"{f.relative_to(REPO)} imports {sorted(ours - allowed)}"


def test_only_the_store_names_array_paths():
    """Array names are spelled in the schema and used by the store: nowhere else."""
    from shared.schema import INDEX_ARRAYS, Layout
    names = set(INDEX_ARRAYS) | set(Layout(1, 1, 1, "fp8", "zstd1", 1, 1, 1, 1).arrays())
    pattern = re.compile("|".join(re.escape(n) for n in sorted(names)))
    for pkg in ("shared", *STAGES):
        for f, tree in modules(pkg):
            if f in (REPO / "shared" / "store.py", REPO / "shared" / "schema.py"):
                continue
            hits = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                    and pattern.fullmatch(n.value)]
            assert not hits, f"{f.relative_to(REPO)} names store arrays {hits}"


def test_main_modules_only_parse_and_call():
    """__main__ modules define no library code a test or another module would import."""
    for pkg in STAGES:
        f = REPO / pkg / "__main__.py"
        if not f.exists():
            continue
        tree = ast.parse(f.read_text())
        defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert defs <= {"main", "parse_args", "_replace_gpus"}, (f, defs)
    for d in ("tests", "bench", *STAGES):
        for f in (REPO / d).rglob("*.py"):
            if f.name == "test_layout.py":
                continue
            for line in f.read_text().splitlines():  # the CLI's main() may be called; nothing else
                if "__main__ import" in line:
                    assert line.strip().endswith("__main__ import main"), (f, line)
