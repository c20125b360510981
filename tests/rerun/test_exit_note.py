"""The re-run exit note (nvrx.common.rerun_exit): written by the rank, read by the agent as untrusted input."""

from __future__ import annotations

import json
import stat

from nvrx.common.rerun_exit import ENV, read_note, remove_note, write_note


def test_note_round_trip_private_and_untrusted_input(tmp_path, caplog):
    path = tmp_path / "agent" / "rerun_exit.json"
    write_note(3, ["n2", "n1", "n1"], env={ENV: str(path)})
    note = read_note(path)
    assert (note.step, note.nodes) == (3, ("n1", "n2"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    write_note(4, ["n1"], env={})                    # outside `nvrx launch`: nowhere, no error
    remove_note(path)
    assert read_note(path) is None and read_note(None) is None
    remove_note(path)                                 # already gone: fine
    for bad in ("{not json", json.dumps({"step": "3", "nodes": ["n1"]}), json.dumps({"step": 3, "nodes": []}),
                json.dumps({"step": 3, "nodes": [7]}), json.dumps([1, 2]), json.dumps({"step": 3, "nodes": ["x" * 600]}),
                json.dumps({"step": 3, "nodes": ["n"] * 70000})):
        path.write_text(bad)
        assert read_note(path) is None
    assert "not a note nvrx wrote" in caplog.text
