"""The README's commands and example stay true."""

import contextlib
import io
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks():
  return re.findall(r"```bash\n(.*?)```", README, re.S)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
  setup = README.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
  commands = [c.strip() for c in re.findall(r"```bash\n(.*?)```", setup, re.S)]
  assert len(commands) == 2
  test_command = next(c for c in commands if "pytest" in c)
  ci = (ROOT / ".ci" / "run").read_text()
  assert test_command in ci.splitlines()


def test_readme_python_example_runs():
  code = re.findall(r"```python\n(.*?)```", README, re.S)[0]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(code, "README.md", "exec"), {})
  assert out.getvalue().strip() == "[0 1 0 2] 0.25"


def _slug(heading):
  """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_in_readme_and_docs_point_at_repo_paths():
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  broken = []
  for page in pages:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue  # a URL or an anchor on the same page
      path, _, anchor = target.partition("#")
      resolved = (page.parent / path).resolve()
      if not resolved.exists() or ROOT not in (resolved, *resolved.parents):
        broken.append(f"{page.relative_to(ROOT)}: {target}")
      elif anchor and resolved.suffix == ".md":
        headings = re.findall(r"^#+ (.+)$", resolved.read_text(), re.M)
        if anchor not in {_slug(h) for h in headings}:
          broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
  assert not broken, broken
