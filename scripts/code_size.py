"""Report the size of the product code and what breaks the size rules.

    python scripts/code_size.py                 # dp_plugin/ and adapters/
    python scripts/code_size.py --max-file 400 --max-function 60 PATH...

Prints the line count of each package (the top-level folders under
``dp_plugin/`` and ``adapters/``, by physical lines as ``wc -l`` counts them),
the total, then every file above ``--max-file`` lines and every function or
method above ``--max-function`` lines (from its ``def`` line, decorators
excluded, to its last line, as ``ast`` reports). Exits 0: it reports, the
reader decides.
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return "/".join(rel[:2]) if len(rel) > 2 else rel[0]


def long_functions(path: Path, limit: int) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of each function above ``limit`` lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > limit:
                    found.append((name[:-1], child.lineno, length))
            visit(child, name)

    visit(tree, "")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path,
                        default=[ROOT / "dp_plugin", ROOT / "adapters"])
    parser.add_argument("--max-file", type=int, default=400)
    parser.add_argument("--max-function", type=int, default=60)
    args = parser.parse_args(argv)
    files = python_files([p.resolve() for p in args.paths])
    lines = {f: len(f.read_text().splitlines()) for f in files}
    per_package: Counter[str] = Counter()
    for f, n in lines.items():
        per_package[package_of(f)] += n
    for package, n in sorted(per_package.items()):
        print(f"{n:7d}  {package}")
    print(f"{sum(lines.values()):7d}  total ({len(files)} files)")
    big = [(f, n) for f, n in lines.items() if n > args.max_file]
    print(f"\nfiles above {args.max_file} lines: {len(big)}")
    for f, n in sorted(big, key=lambda item: -item[1]):
        print(f"{n:7d}  {f.relative_to(ROOT)}")
    long = [(f, *entry) for f in files for entry in long_functions(f, args.max_function)]
    print(f"\nfunctions above {args.max_function} lines: {len(long)}")
    for f, name, line, n in sorted(long, key=lambda item: -item[3]):
        print(f"{n:7d}  {f.relative_to(ROOT)}:{line} {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
