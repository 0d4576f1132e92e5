"""No import cycles among the library's modules (salt_jax, salt_jax.models, salt_jax.agent, envs).

Read from the source with `ast`, so nothing is imported: every `import` statement counts, at module
level or inside a function (a function-level import that closes a cycle only defers it to run
time). An edge goes to the module a statement names: `from salt_jax import sampling` is an edge to
`salt_jax.sampling`, and `from salt_jax import refine` one to the package `salt_jax`. The implicit
import of a module's parent package is not an edge: every package imports its own submodules.

`python tests/test_imports.py` prints every cycle.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("salt_jax", "envs")


def module_files() -> dict[str, str]:
  """Dotted module name -> file path, for every .py file under PACKAGES."""
  out = {}
  for package in PACKAGES:
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
      for name in files:
        if not name.endswith(".py"):
          continue
        parts = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].split(os.sep)
        if parts[-1] == "__init__":
          parts = parts[:-1]
        out[".".join(parts)] = os.path.join(folder, name)
  return out


def _imported(node: ast.AST, module: str, is_package: bool, known) -> set[str]:
  """The known modules one import statement names."""
  if isinstance(node, ast.Import):
    return {alias.name for alias in node.names if alias.name in known}
  if node.level:  # relative: from the module's own package, up level - 1 more
    base = (module if is_package else module.rpartition(".")[0]).split(".")
    base = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
  else:
    base = node.module
  out = set()
  for alias in node.names:
    if f"{base}.{alias.name}" in known:
      out.add(f"{base}.{alias.name}")
    elif base in known:
      out.add(base)
  return out


def import_graph() -> dict[str, set[str]]:
  """Module -> the known modules it imports anywhere in its source."""
  files = module_files()
  graph = {}
  for module, path in files.items():
    with open(path) as fh:
      tree = ast.parse(fh.read(), path)
    is_package = path.endswith("__init__.py")
    edges = set()
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        edges |= _imported(node, module, is_package, files)
    graph[module] = edges - {module}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(out)


def test_no_import_cycles():
  assert cycles(import_graph()) == []


def test_cycle_finder_sees_a_cycle_through_a_function_level_import():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert cycles(graph) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


if __name__ == "__main__":
  for component in cycles(import_graph()):
    print(" <-> ".join(component))
