"""docs/faults.md shows the fault matrix as the tests in tests/faults/ define it (their docstrings)."""

from __future__ import annotations

from tests.faults import table


def test_every_matrix_test_documents_its_fault_and_outcome():
    assert len(table.rows()) >= 25
    assert table.undocumented() == []


def test_docs_fault_table_is_up_to_date():
    doc = table.DOC.read_text()
    assert table.render(doc) == doc, "docs/faults.md is stale: run `python -m tests.faults.table --write`"
