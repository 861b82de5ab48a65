"""What watches many records: the learned prefill rates, attempt groups (and, as the house moves, metrics, ledger, exporters)."""
