"""tools/book.py: executed notebooks are reused only while nothing they depend on changed, and a failing notebook
stops the build with a message naming the notebook and the cell."""
import json

import nbformat
import pytest

from tools import book


def _notebook(path, body: str):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('scale = "cpu"\nout_dir = "x"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_fingerprint_tracks_source_and_parameters(tmp_path):
    nb = _notebook(tmp_path / "a.ipynb", "print(scale)")
    base = book.fingerprint(nb, {"scale": "smoke"})
    assert book.fingerprint(nb, {"scale": "smoke"}) == base
    assert book.fingerprint(nb, {"scale": "cpu"}) != base
    _notebook(nb, "print(scale, 2)")
    assert book.fingerprint(nb, {"scale": "smoke"}) != base


def test_executed_notebook_is_reused_until_it_changes(tmp_path):
    nb = _notebook(tmp_path / "ok.ipynb", "print('ran at', scale)")
    executed, first = book.execute(nb, "smoke", executed_root=tmp_path / "exec")
    assert executed.exists() and first["scale"] == "smoke" and first["parameters"]["scale"] == "smoke"
    assert {"git_commit", "packages", "wall_time_s", "fingerprint"} <= set(first)
    _, again = book.execute(nb, "smoke", executed_root=tmp_path / "exec")
    assert again == first  # reused: the same provenance record, nothing re-run
    _notebook(nb, "print('changed', scale)")
    _, third = book.execute(nb, "smoke", executed_root=tmp_path / "exec")
    assert third["fingerprint"] != first["fingerprint"]
    record = json.loads((tmp_path / "exec" / "smoke" / "ok.provenance.json").read_text())
    assert record == third


def test_failing_notebook_names_notebook_and_cell(tmp_path):
    nb = _notebook(tmp_path / "broken.ipynb", "raise RuntimeError('deliberate failure')")
    with pytest.raises(book.NotebookFailed) as err:
        book.execute(nb, "smoke", executed_root=tmp_path / "exec")
    message = str(err.value)
    assert "broken.ipynb" in message and "cell index 2" in message and "deliberate failure" in message
    assert not (tmp_path / "exec" / "smoke" / "broken.ipynb").exists()  # no executed copy of a failed run


def test_unknown_scale_is_refused(capsys):
    with pytest.raises(SystemExit):
        book.main(["--scale", "huge"])
    assert "smoke, cpu, full" in capsys.readouterr().err


def test_every_notebook_has_a_chapter_and_stays_output_free():
    """One chapter per notebook (the book renders its executed copy), and sources are stored without outputs."""
    import yaml

    toc = yaml.safe_load((book.ROOT / "_toc.yml").read_text())
    chapters = {c["file"] for part in toc.get("parts", []) for c in part.get("chapters", [])}
    for path in sorted(book.NOTEBOOKS.glob("*.ipynb")):
        assert f"book/generated/{path.stem}" in chapters, f"{path.name} has no chapter in _toc.yml"
        nb = nbformat.read(path, as_version=4)
        dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{path.name} is stored with outputs in cells {dirty}"
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1 and "scale" in tagged[0].source, f"{path.name}: one 'parameters' cell with scale"
