"""What watches many records: the learned prefill rates, attempt groups, trace export (and, as the house moves, metrics, ledger)."""
