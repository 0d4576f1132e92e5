"""Every notebook in colab/ runs top to bottom on this CPU (cells needing an accelerator skip
themselves), so the notebooks never rot.

`python tests/test_notebooks.py [colab/x.ipynb ...]` runs them (all by default) the same way and
writes their outputs into them: the committed outputs GitHub shows.
"""

import os
import pathlib
import sys
import tempfile

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


def kernel_pythonpath() -> str:
  """The kernel's PYTHONPATH: this checkout first, whatever salt-jax is installed (or not)."""
  return os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def execute(path, workdir) -> nbformat.NotebookNode:
  """Notebook `path` run top to bottom by a fresh kernel in folder `workdir`, with its outputs."""
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                 resources={"metadata": {"path": str(workdir)}}).execute()
  return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
  monkeypatch.setenv("PYTHONPATH", kernel_pythonpath())
  nb = execute(path, tmp_path)
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors


def _install_cell(path) -> str:
  return next(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")


def test_each_notebook_starts_with_the_same_install_cell():
  cells = [_install_cell(p) for p in NOTEBOOKS]
  # One cell for all, up to its EXTRAS line; the repository named once; nothing to fill in.
  strip = lambda s: "\n".join(l for l in s.splitlines() if not l.startswith("EXTRAS = "))  # noqa: E731
  assert len({strip(c) for c in cells}) == 1
  for path, cell in zip(NOTEBOOKS, cells):
    assert cell.count("https://github.com/") == 1 and "SALT_JAX_GIT = " not in cell
    assert "REPO_URL" not in path.read_text(encoding="utf-8")
    # No exact pin over the runtime's packages: only jax's plugin, at the jax salt-jax installed.
    assert cell.replace("=={importlib.metadata.version('jax')}", "").count("==") == 0


def test_install_cell_is_a_noop_when_importable_and_reads_the_accelerator(monkeypatch, capsys):
  import glob
  import shutil
  import subprocess

  monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
  ns: dict = {}
  exec(_install_cell(NOTEBOOKS[0]), ns)  # pylint: disable=exec-used
  assert "nothing to install" in capsys.readouterr().out
  # where it installs from: $SALT_JAX_GIT, else the repository and branch Colab opened it from
  source = ns["repository_source"]
  monkeypatch.delenv("SALT_JAX_GIT", raising=False)
  assert source("https://colab.research.google.com/github/me/salt-jax/blob/dev/colab/x.ipynb") \
      == "git+https://github.com/me/salt-jax.git@dev"
  with pytest.raises(SystemExit, match="SALT_JAX_GIT"):
    source("")
  monkeypatch.setenv("SALT_JAX_GIT", "git+https://example.org/fork.git")
  assert source("") == "git+https://example.org/fork.git"
  attached = ns["attached_accelerator"]
  devices: list = []
  monkeypatch.setattr(glob, "glob", lambda pattern: [p for p in devices if p[:8] == pattern[:8]])
  monkeypatch.setattr(shutil, "which", lambda name: None)
  for var in ("TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR"):
    monkeypatch.delenv(var, raising=False)
  assert attached() is None
  for dev in ("/dev/accel0", "/dev/vfio/0"):  # TPU v2 to v5e; v5p and v6e
    devices[:] = [dev]
    assert attached() == "tpu"
  devices[:] = ["/dev/nvidia0"]
  assert attached() == "gpu"
  devices[:] = []
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-1")
  assert attached() == "tpu"
  monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
  monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
  assert attached() == "gpu"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_notebook_holds_its_outputs(path):
  # GitHub shows a notebook as committed: every code cell ran, none failed, and the plots are in.
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.execution_count is not None for c in code)
  outputs = [o for c in code for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs)
  # no tqdm warning for the missing ipywidgets (transformers' import; `import salt_jax` stops it)
  assert not [o for o in outputs if "IProgress not found" in str(o.get("text", ""))]


def coalesce_streams(nb) -> None:
  """Each run of stream outputs (stdout or stderr) of a cell as one output, every line as a
  notebook front end shows it after its carriage returns (a progress bar's last state): nbclient
  stores every write apart."""
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    merged = []
    for o in cell.outputs:
      last = merged[-1] if merged else None
      if (o.output_type == "stream" and last is not None and last.output_type == "stream"
          and last.name == o.name):
        last.text += o.text
      else:
        merged.append(o)
    for o in merged:
      if o.output_type == "stream":
        o.text = "\n".join(line.rsplit("\r", 1)[-1] for line in o.text.split("\n"))
    cell.outputs = [o for o in merged if o.output_type != "stream" or o.text.strip()]


if __name__ == "__main__":
  os.environ["PYTHONPATH"] = kernel_pythonpath()
  root = pathlib.Path(tempfile.mkdtemp(prefix="colab-run-"))
  for arg in sys.argv[1:] or NOTEBOOKS:
    nb_path = pathlib.Path(arg).resolve()
    (root / nb_path.stem).mkdir()
    print(f"running {nb_path.name} in {root / nb_path.stem}", flush=True)
    nb = execute(nb_path, root / nb_path.stem)
    coalesce_streams(nb)
    nbformat.write(nb, nb_path)
